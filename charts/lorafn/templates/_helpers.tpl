{{- define "lorafn.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lorafn.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "lorafn.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "lorafn.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lorafn.labels" -}}
app.kubernetes.io/name: {{ include "lorafn.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorafn
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lorafn.selector" -}}
app.kubernetes.io/name: {{ include "lorafn.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lorafn.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "lorafn.redisURL" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc.cluster.local:6379/0" (include "lorafn.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.externalURL is required when redis.enabled is false" .Values.redis.externalURL -}}
{{- end -}}
{{- end -}}

{{- define "lorafn.gatewayURL" -}}
{{- if .Values.gateway.externalURL -}}
{{- .Values.gateway.externalURL | trimSuffix "/" -}}
{{- else -}}
{{- printf "http://%s-gateway.%s.svc.cluster.local" (include "lorafn.fullname" .) .Release.Namespace -}}
{{- if ne (int .Values.gateway.service.port) 80 }}:{{ .Values.gateway.service.port }}{{ end -}}
{{- end -}}
{{- end -}}

{{- define "lorafn.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "lorafn.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}
