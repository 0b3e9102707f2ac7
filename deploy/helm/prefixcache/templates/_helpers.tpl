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
grpc.health.v1 over PREFIXCACHE_LISTEN (Kubernetes' grpc probes need a TCP port, and the
server listens on a unix socket). The Dockerfile's HEALTHCHECK runs the same code.
*/}}
{{- define "prefixcache.healthCheck" -}}
import os,sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;c=grpc.insecure_channel(os.environ.get('PREFIXCACHE_LISTEN','unix:/tmp/prefixcache.sock'));r=g.HealthStub(c).Check(h.HealthCheckRequest(service=(sys.argv+[''])[1]),timeout=3);sys.exit(r.status!=h.HealthCheckResponse.SERVING)
{{- end }}

{{/* A probe's action; call with (list $ "service name"). */}}
{{- define "prefixcache.probe" -}}
{{- $ := index . 0 }}
{{- if $.Values.tls.enabled -}}
tcpSocket:
  port: grpc
{{- else -}}
exec:
  command:
    - python
    - -c
    - {{ include "prefixcache.healthCheck" $ | quote }}
    {{- with index . 1 }}
    - {{ . }}
    {{- end }}
{{- end }}
{{- end }}
