{{/* Names, labels and shared fragments (bitnami style: one template per object, helpers here). */}}

{{- define "fleetroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fleetroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetroute.labels" -}}
{{ include "fleetroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "fleetroute.annotations" -}}
{{- with .Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "fleetroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "fleetroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fleetroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "fleetroute.workerName" -}}
{{- printf "%s-%s" (include "fleetroute.fullname" .root) .pool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Secrets. Each secret comes from an existing Secret the user names, or lives in a Secret of the chart's own,
holding the value given in values, else the value that Secret already holds, else a generated one.
*/}}
{{- define "fleetroute.adminSecretName" -}}
{{- default (printf "%s-admin" (include "fleetroute.fullname" .)) .Values.router.adminToken.existingSecret -}}
{{- end -}}

{{- define "fleetroute.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "fleetroute.fullname" .)) .Values.router.apiKeys.existingSecret -}}
{{- end -}}

{{- define "fleetroute.redisSecretName" -}}
{{- default (printf "%s-redis" (include "fleetroute.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/*
The value of one key of a chart-owned Secret: `given` if set; else what the Secret `name` already holds, so a
generated secret survives `helm upgrade` (`lookup` reads the live object); else `generate`. `helm template`
and client-side dry runs have no cluster: `lookup` finds nothing there, and every render generates anew.
Args: root, name, key, given, generate.
*/}}
{{- define "fleetroute.secretValue" -}}
{{- if .given -}}
{{- .given -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- $data := dig "data" .key "" $existing -}}
{{- if $data -}}{{- b64dec $data -}}{{- else -}}{{- .generate -}}{{- end -}}
{{- end -}}
{{- end -}}

{{/*
What a pod's `checksum/secrets` annotation hashes, so that pods roll when a secret they read changes: the values
given and, for a Secret the user owns, its live data (read with `lookup` at install and upgrade; a rotated
Secret rolls the pods at the next `helm upgrade`). A generated secret never changes once made, so it adds
nothing: hashing it would roll every pod at the first upgrade, when `lookup` first sees it.
Args: root, given, existingSecret.
*/}}
{{- define "fleetroute.secretInput" -}}
{{- toJson (list .given .existingSecret) -}}
{{- with .existingSecret -}}
{{- toJson (lookup "v1" "Secret" $.root.Release.Namespace .).data -}}
{{- end -}}
{{- end -}}

{{- define "fleetroute.checksum.adminToken" -}}
{{- include "fleetroute.secretInput" (dict "root" . "given" .Values.router.adminToken.value "existingSecret" .Values.router.adminToken.existingSecret) -}}
{{- end -}}

{{- define "fleetroute.checksum.apiKeys" -}}
{{- if .Values.router.apiKeys.enabled -}}
{{- include "fleetroute.secretInput" (dict "root" . "given" (join "\n" .Values.router.apiKeys.keys) "existingSecret" .Values.router.apiKeys.existingSecret) -}}
{{- end -}}
{{- end -}}

{{- define "fleetroute.checksum.redis" -}}
{{- if include "fleetroute.redisAuth" . -}}
{{- include "fleetroute.secretInput" (dict "root" . "given" .Values.redis.auth.password "existingSecret" .Values.redis.auth.existingSecret) -}}
{{- else if and .Values.redis.enabled .Values.redis.external.existingSecret -}}
{{- include "fleetroute.secretInput" (dict "root" . "given" "" "existingSecret" .Values.redis.external.existingSecret) -}}
{{- end -}}
{{- end -}}

{{/* Where the router reads its client API keys (config auth.apiKeysFile): the key file of the Secret. */}}
{{- define "fleetroute.apiKeysFile" -}}
/etc/fleetroute-secrets/api-keys
{{- end -}}

{{- define "fleetroute.builtinRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/* The built-in Redis requires a password (the chart's Secret or the user's). */}}
{{- define "fleetroute.redisAuth" -}}
{{- if and (include "fleetroute.builtinRedis" .) .Values.redis.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The Redis URL written into the router config and the agents' flags; empty when it carries a secret (an external
URL from a Secret, the built-in Redis with a password: both reach the containers as $REDIS_URL, never the
ConfigMap) or when Redis is off.
*/}}
{{- define "fleetroute.redisUrl" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.existingSecret) (not (include "fleetroute.redisAuth" .)) -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- printf "redis://%s-redis:%d/0" (include "fleetroute.fullname" .) (int .Values.redis.port) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* $REDIS_URL (and what it is built from) for router and agent containers, when the URL carries a secret. */}}
{{- define "fleetroute.redisEnv" -}}
{{- if include "fleetroute.redisAuth" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetroute.redisSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretKey }}
# The kubelet expands $(REDIS_PASSWORD), defined just above, when it starts the container.
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:%d/0" (include "fleetroute.fullname" .) (int .Values.redis.port) | quote }}
{{- else if and .Values.redis.enabled .Values.redis.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- end }}
{{- end -}}

{{/*
Every pool with the `worker` defaults filled in, as YAML `{pools: [...]}` (read it back with fromYaml: numbers
come back as floats). Object fields (rollout, pdb, startupProbe, cache, autoscaling) are merged key by key, so
that a pool's `false` or `0` overrides a default (sprig's mergeOverwrite would keep the default).
*/}}
{{- define "fleetroute.pools" -}}
{{- $out := list -}}
{{- range .Values.pools -}}
{{- $pool := deepCopy . -}}
{{- $defaults := dict "replicaCount" 1 "gpus" 1 "shmSize" "2Gi" "runtimeClassName" $.Values.worker.runtimeClassName "engine" (dict) "resources" (dict) -}}
{{- range $key, $default := $defaults -}}
{{- if not (hasKey $pool $key) -}}{{- $_ := set $pool $key $default -}}{{- end -}}
{{- end -}}
{{- range $key := list "rollout" "pdb" "startupProbe" "cache" "autoscaling" -}}
{{- $merged := deepCopy (index $.Values.worker $key) -}}
{{- range $k, $v := (index $pool $key | default dict) -}}{{- $_ := set $merged $k $v -}}{{- end -}}
{{- $_ := set $pool $key $merged -}}
{{- end -}}
{{- $out = append $out $pool -}}
{{- end -}}
{{- toYaml (dict "pools" $out) -}}
{{- end -}}

{{/* The model cache's PersistentVolumeClaim of a pool (cache.type persistentVolumeClaim or existingClaim). */}}
{{- define "fleetroute.cacheClaim" -}}
{{- if eq .pool.cache.type "existingClaim" -}}
{{- .pool.cache.existingClaim -}}
{{- else -}}
{{- printf "%s-models" (include "fleetroute.workerName" .) -}}
{{- end -}}
{{- end -}}

{{/* A Kubernetes quantity (100Gi, 1.5G, 512Mi, 10000) in bytes. */}}
{{- define "fleetroute.bytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $scale := dict "" 1.0 "m" 0.001 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 -}}
{{- mulf (float64 $num) (get $scale (trimPrefix $num $q)) | ceil | int64 -}}
{{- end -}}

{{/* A byte count as a quantity: in Gi or Mi when it is a whole number of them. */}}
{{- define "fleetroute.quantity" -}}
{{- $b := int64 . -}}
{{- if eq (mod $b 1073741824) 0 -}}{{ div $b 1073741824 }}Gi
{{- else if eq (mod $b 1048576) 0 -}}{{ div $b 1048576 }}Mi
{{- else -}}{{ $b }}{{- end -}}
{{- end -}}

{{/* The container security context of our own (fleetroute, redis) containers. */}}
{{- define "fleetroute.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The Lease that elects the one router replica that writes RoutingPolicy status (one per release). */}}
{{- define "fleetroute.routingPolicyLease" -}}
{{- printf "%s-routing-policy-status" (include "fleetroute.fullname" .) -}}
{{- end -}}

{{/*
The models delegated to RoutingPolicies: the pools' servedModelNames (routingPolicyControl.delegatePoolModels),
routingPolicyControl.allowedModels, and the models of the chart's own routingPolicies (the CRD's default, "*",
where one names none) with the names and targets of their model aliases, so that what the chart creates is
applied.
*/}}
{{- define "fleetroute.delegatedModels" -}}
{{- $models := list -}}
{{- if .Values.routingPolicyControl.delegatePoolModels -}}
{{- range .Values.pools -}}
{{- range .servedModelNames -}}
{{- $models = append $models . -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range .Values.routingPolicyControl.allowedModels -}}
{{- $models = append $models . -}}
{{- end -}}
{{- range .Values.routingPolicies -}}
{{- range (default (list "*") .spec.models) -}}
{{- $models = append $models . -}}
{{- end -}}
{{- range (.spec.aliases | default list) -}}
{{- $models = append $models .name -}}
{{- range .targets -}}
{{- $models = append $models .model -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson (uniq $models) -}}
{{- end -}}

{{/*
The router's YAML config. Discovery watches the EndpointSlices of this release's pool Services, named one by one
(docs/kubernetes.md#trust-model: a Service someone else creates with the workers' labels is not followed), and
reads each pod's models from the fleetroute.io/models annotation. With routingPolicyControl.enabled the routers
watch the release namespace's RoutingPolicies, within the delegation the values give.
*/}}
{{- define "fleetroute.routerConfig" -}}
{{- $services := list -}}
{{- range .Values.pools -}}
{{- $services = append $services (include "fleetroute.workerName" (dict "root" $ "pool" .)) -}}
{{- end -}}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.router.containerPorts.http) "trustedProxies" .Values.router.trustedProxies
            "maxConnections" .Values.router.maxConnections "maxConnectionsPerClient" (int .Values.router.maxConnectionsPerClient))
  "admin" (dict "host" "0.0.0.0" "port" (int .Values.router.containerPorts.admin) "tokenEnv" "FLEETROUTE_ADMIN_TOKEN")
  "workers" (int .Values.router.workers)
  "shutdownGrace" (printf "%ds" (int .Values.router.shutdownGraceSeconds))
  "logging" (dict "level" .Values.router.logLevel "accessLog" .Values.router.accessLog)
  "policies" .Values.router.policies
-}}
{{- if .Values.router.apiKeys.enabled -}}
{{- $_ := set $cfg "auth" (dict "apiKeysFile" (include "fleetroute.apiKeysFile" .)) -}}
{{- end -}}
{{- with .Values.router.tenancy -}}
{{- $_ := set $cfg "tenancy" (deepCopy .) -}}
{{- end -}}
{{- with .Values.router.tracing -}}
{{- if .enabled -}}
{{- $tracing := dict "enabled" true "endpoint" .endpoint "serviceName" (.serviceName | default (include "fleetroute.fullname" $)) "sampleRatio" .sampleRatio -}}
{{- if .headersSecret.name -}}
{{- $_ := set $tracing "headersEnv" "FLEETROUTE_OTLP_HEADERS" -}}
{{- end -}}
{{- $_ := set $cfg "tracing" $tracing -}}
{{- end -}}
{{- end -}}
{{- if $services -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" (dict
      "services" $services
      "namespace" .Release.Namespace
      "port" "http"
      "modelAnnotation" "fleetroute.io/models")) -}}
{{- end -}}
{{- with .Values.routingPolicyControl -}}
{{- if .enabled -}}
{{- $_ := set $cfg "control" (dict "kubernetes" (dict
      "namespace" $.Release.Namespace
      "leaseName" (include "fleetroute.routingPolicyLease" $)
      "allowedModels" (include "fleetroute.delegatedModels" $ | fromJsonArray)
      "maxPriority" (int .maxPriority)
      "overrideFilePolicies" .overrideFilePolicies)) -}}
{{- end -}}
{{- end -}}
{{- $url := include "fleetroute.redisUrl" . -}}
{{- if $url -}}
{{- $_ := set $cfg "redis" (dict "url" $url) -}}
{{- else if not .Values.redis.enabled -}}
{{- $_ := set $cfg "redis" (dict "url" nil) -}}
{{- end -}}
{{- $merged := mergeOverwrite $cfg (deepCopy .Values.router.extraConfig) -}}
{{- toYaml $merged -}}
{{- end -}}

{{/* The endpoint picker (epp.enabled): its objects' name, and the InferencePool's (the pool of every worker). */}}
{{- define "fleetroute.eppName" -}}
{{- printf "%s-epp" (include "fleetroute.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetroute.inferencePoolName" -}}
{{- include "fleetroute.fullname" . -}}
{{- end -}}

{{- define "fleetroute.eppServiceAccountName" -}}
{{- if .Values.epp.serviceAccount.create -}}
{{- default (include "fleetroute.eppName" .) .Values.epp.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.epp.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The endpoint picker's config: the router's (fleetroute.routerConfig: policies, health, telemetry, Redis, the
admin listener, RoutingPolicies, router.extraConfig), with discovery from the chart's InferencePool instead of
the pool Services, and without what only the HTTP ingress uses (client API keys: the gateway authenticates
clients; `listen`; several processes).
*/}}
{{- define "fleetroute.eppConfig" -}}
{{- $cfg := include "fleetroute.routerConfig" . | fromYaml -}}
{{- $_ := unset $cfg "listen" -}}
{{- $_ := unset $cfg "workers" -}}
{{- if $cfg.auth -}}
{{- $_ := unset $cfg.auth "apiKeysFile" -}}
{{- if not $cfg.auth -}}{{- $_ := unset $cfg "auth" -}}{{- end -}}
{{- end -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" (dict
      "inferencePool" (include "fleetroute.inferencePoolName" .)
      "namespace" .Release.Namespace
      "modelAnnotation" "fleetroute.io/models")) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The environment of a router or endpoint-picker container: the admin token, Redis, the OTLP headers. */}}
{{- define "fleetroute.routerEnv" -}}
# The root filesystem is read-only: no .pyc files.
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
# Named by the config's admin.tokenEnv: the router refuses to start without it.
- name: FLEETROUTE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetroute.adminSecretName" . }}
      key: {{ .Values.router.adminToken.existingSecretKey }}
{{- with include "fleetroute.redisEnv" . }}{{ . | trim | nindent 0 }}{{ end }}
{{- if and .Values.router.tracing.enabled .Values.router.tracing.headersSecret.name }}
# Named by the config's tracing.headersEnv: headers for every OTLP export (a collector's API key).
- name: FLEETROUTE_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.router.tracing.headersSecret.name }}
      key: {{ .Values.router.tracing.headersSecret.key }}
{{- end }}
{{- end -}}

{{/*
Who the gateway is, for NetworkPolicies (epp.enabled): it calls the endpoint picker's gRPC port and sends the
requests to the workers itself. networkPolicy.gateway, else the namespace of the Gateway epp.httpRoute names
(else the release's): Istio and kgateway run a Gateway's proxies there; Envoy Gateway, by default, in its own
namespace (envoy-gateway-system), which networkPolicy.gateway must then name.
*/}}
{{- define "fleetroute.gatewayPeers" -}}
{{- if .Values.networkPolicy.gateway -}}
{{- toYaml .Values.networkPolicy.gateway -}}
{{- else -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Values.epp.httpRoute.gateway.namespace | default .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* The Role rules RoutingPolicies need (routingPolicyControl.enabled): the router's, and the endpoint picker's. */}}
{{- define "fleetroute.routingPolicyRules" -}}
# The RoutingPolicy watch lists and watches (it never reads one object by name) and patches status.
- apiGroups: ["fleetroute.io"]
  resources: ["routingpolicies"]
  verbs: ["list", "watch"]
- apiGroups: ["fleetroute.io"]
  resources: ["routingpolicies/status"]
  verbs: ["patch"]
# One router replica writes RoutingPolicy status: leader election with one Lease, read and renewed by name.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "fleetroute.routingPolicyLease" . | quote }}]
  verbs: ["get", "update"]
# The first replica creates that Lease. RBAC cannot limit create to a name: the object does not exist when
# the request is authorized, so a create rule with resourceNames would never match
# (https://kubernetes.io/docs/reference/access-authn-authz/rbac/#referring-to-resources).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
{{- end -}}
