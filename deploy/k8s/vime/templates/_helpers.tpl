{{/* Names, labels and the environment every vime container shares. */}}

{{- define "vime.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vime.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "vime.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vime.image" -}}
{{- printf "%s:%s" .repository (.tag | default "") -}}
{{- end -}}

{{- define "vime.tokenSecret" -}}
{{- .Values.apiToken.existingSecret | default (printf "%s-api-token" (include "vime.fullname" .)) -}}
{{- end -}}

{{- define "vime.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "vime.fullname" .) -}}
{{- else -}}
{{- required "redis.url is required when redis.enabled is false" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "vime.enginePorts" -}}
{{- $base := int (.Values.runConfig.engine.base_port | default 18100) -}}
port: {{ $base }}
endPort: {{ add $base (int .Values.colocated.maxEngines) -1 }}
{{- end -}}

{{/* Environment of every vime container: token from the Secret, where the others are. */}}
{{- define "vime.env" -}}
- name: VIME_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "vime.tokenSecret" . }}
      key: {{ .Values.apiToken.secretKey }}
- name: VIME_SERVICES__HOST
  value: 0.0.0.0
- name: VIME_SERVICES__REDIS_URL
  value: {{ include "vime.redisUrl" . | quote }}
- name: VIME_SERVICES__ROUTER_URL
  value: {{ printf "http://%s-router:%d" (include "vime.fullname" .) (int .Values.ports.router) | quote }}
- name: VIME_SERVICES__ROUTER_CONTROL_URL
  value: {{ printf "http://%s-router-control:%d" (include "vime.fullname" .) (int .Values.ports.routerControl) | quote }}
- name: VIME_SERVICES__REWARD_URL
  value: {{ printf "http://%s-reward:%d" (include "vime.fullname" .) (int .Values.ports.reward) | quote }}
- name: VIME_SERVICES__TRAINER_URL
  value: {{ printf "http://%s-trainer:%d" (include "vime.fullname" .) (int .Values.ports.trainer) | quote }}
{{- end -}}

{{/* Startup, readiness and liveness probes on GET /health of one port. */}}
{{- define "vime.probes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 10
  failureThreshold: {{ .startupFailures | default 30 }}
readinessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{- define "vime.containerSecurity" -}}
allowPrivilegeEscalation: false
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* A data volume: hostPath, an existing claim, the chart's claim, or emptyDir when disabled. */}}
{{- define "vime.dataVolume" -}}
- name: {{ .name }}
{{- $p := index .ctx.Values.persistence .name }}
{{- if $p.hostPath }}
  hostPath: {path: {{ $p.hostPath | quote }}, type: DirectoryOrCreate}
{{- else if $p.existingClaim }}
  persistentVolumeClaim: {claimName: {{ $p.existingClaim | quote }}}
{{- else if $p.enabled }}
  persistentVolumeClaim: {claimName: {{ printf "%s-%s" (include "vime.fullname" .ctx) .name }}}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}
