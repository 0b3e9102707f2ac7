{{/* The chart's name, and the objects' name: the release name, suffixed unless it holds the chart's name. */}}
{{- define "prefixcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefixcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "prefixcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefixcache.labels" -}}
{{ include "prefixcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "prefixcache.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "prefixcache.authSecret" -}}
{{ .Values.auth.secretName | default (printf "%s-auth" (include "prefixcache.fullname" .)) }}
{{- end }}

{{- define "prefixcache.socket" -}}
unix:{{ .Values.socketDir }}/prefixcache.sock
{{- end }}

{{/*
A probe's action; call with (list $ "service name"). `prefixcache health` asks the
grpc.health.v1 service at PREFIXCACHE_LISTEN (Kubernetes' grpc probes need a TCP port,
and the server listens on a unix socket); the Dockerfile's HEALTHCHECK runs it too.
With TLS no probe has the client credentials, so it only checks the port is open.
*/}}
{{- define "prefixcache.probe" -}}
{{- $ := index . 0 }}
{{- if $.Values.tls.enabled -}}
tcpSocket:
  port: grpc
{{- else -}}
exec:
  command:
    - prefixcache
    - health
    {{- with index . 1 }}
    - --service
    - {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{/* The tier's master address: the one given, else this chart's mooncake_master. */}}
{{- define "prefixcache.tierMaster" -}}
{{- if .Values.tier.address -}}
{{- .Values.tier.address -}}
{{- else -}}
{{- printf "%s-mooncake-master:%v" (include "prefixcache.fullname" .) .Values.tier.master.rpcPort -}}
{{- end -}}
{{- end }}

{{/* server.tier as JSON for PREFIXCACHE_TIER (secret_file: the tier Secret's mount). */}}
{{- define "prefixcache.tier" -}}
{{- $tier := merge (dict "backend" "mooncake" "master" (include "prefixcache.tierMaster" .) "local_hostname" "$(POD_IP)") .Values.tier.settings -}}
{{- if .Values.tier.secretName -}}
{{- $_ := set $tier "secret_file" (printf "/etc/prefixcache-tier/%s" .Values.tier.secretKey) -}}
{{- end -}}
{{- toJson $tier -}}
{{- end }}

{{/* server.disk as JSON (PREFIXCACHE_DISK). */}}
{{- define "prefixcache.disk" -}}
{{- toJson (merge (dict "path" .Values.disk.path "bytes" (int64 .Values.disk.bytes)) .Values.disk.settings) -}}
{{- end }}

{{/* The master's own labels: never the sidecar's selector, so neither's Deployment or
Service selects the other's pods. */}}
{{- define "prefixcache.masterSelectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixcache.name" . }}-mooncake-master
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefixcache.masterLabels" -}}
{{ include "prefixcache.masterSelectorLabels" . }}
app.kubernetes.io/component: mooncake-master
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
