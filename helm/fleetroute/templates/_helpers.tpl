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

{{- define "fleetroute.adminSecretName" -}}
{{- default (printf "%s-admin" (include "fleetroute.fullname" .)) .Values.router.adminToken.existingSecret -}}
{{- end -}}

{{- define "fleetroute.hasAdminToken" -}}
{{- if or .Values.router.adminToken.existingSecret .Values.router.adminToken.value -}}true{{- end -}}
{{- end -}}

{{/* The Redis URL written into configs and agent flags; empty when it comes from a Secret or Redis is off. */}}
{{- define "fleetroute.redisUrl" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.existingSecret) -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- printf "redis://%s-redis:%d/0" (include "fleetroute.fullname" .) (int .Values.redis.port) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fleetroute.builtinRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/* REDIS_URL from the external Secret, for router and agent containers. */}}
{{- define "fleetroute.redisEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- end }}
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
The models delegated to RoutingPolicies: routingPolicyControl.allowedModels plus the models of the chart's own
routingPolicies (the CRD's default, "*", where one names none), so that what the chart creates is applied.
*/}}
{{- define "fleetroute.delegatedModels" -}}
{{- $models := list -}}
{{- range .Values.routingPolicyControl.allowedModels -}}
{{- $models = append $models . -}}
{{- end -}}
{{- range .Values.routingPolicies -}}
{{- range (default (list "*") .spec.models) -}}
{{- $models = append $models . -}}
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
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.router.containerPorts.http))
  "admin" (dict "host" "0.0.0.0" "port" (int .Values.router.containerPorts.admin))
  "workers" (int .Values.router.workers)
  "shutdownGrace" (printf "%ds" (int .Values.router.shutdownGraceSeconds))
  "logging" (dict "level" .Values.router.logLevel "accessLog" .Values.router.accessLog)
  "policies" .Values.router.policies
-}}
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
