{{/* `from:`/`to:` with the given NetworkPolicy peers; nothing (any address) when there are none. Args: key, peers. */}}
{{- define "fleetroute.peers" -}}
{{- with .peers }}
{{ $.key }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* DNS egress (port 53, UDP and TCP): without it no Service name resolves. */}}
{{- define "fleetroute.dnsEgress" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
  {{- with include "fleetroute.peers" (dict "key" "to" "peers" .Values.networkPolicy.dns) }}{{ . | trim | nindent 2 }}{{ end }}
{{- end -}}

{{/* Egress to Redis: the built-in one's pods, or an external one's addresses and ports. */}}
{{- define "fleetroute.redisEgress" -}}
{{- if include "fleetroute.builtinRedis" . -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "fleetroute.selectorLabels" . | nindent 10 }}
          app.kubernetes.io/component: redis
  ports:
    - port: {{ .Values.redis.port }}
      protocol: TCP
{{- else if .Values.redis.enabled -}}
- ports:
    {{- range .Values.networkPolicy.externalRedis.ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
  {{- with include "fleetroute.peers" (dict "key" "to" "peers" .Values.networkPolicy.externalRedis.to) }}{{ . | trim | nindent 2 }}{{ end }}
{{- end -}}
{{- end -}}
