{{/* Names ---------------------------------------------------------------------------- */}}

{{- define "nibble.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "nibble.fullname" -}}
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

{{- define "nibble.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* KubeRay accepts RayCluster names of at most 53 characters (DNS-1035). */}}
{{- define "nibble.rayClusterName" -}}
{{- include "nibble.fullname" . | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{/* The GCS address of the head, through the Service KubeRay creates (<cluster>-head-svc). */}}
{{- define "nibble.rayHeadAddress" -}}
{{- printf "%s-head-svc.%s.svc.%s:6379" (include "nibble.rayClusterName" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "nibble.secretName" -}}
{{- default (printf "%s-secrets" (include "nibble.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "nibble.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "nibble.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "nibble.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Labels --------------------------------------------------------------------------- */}}

{{/* Labels that select nothing; pod templates add them to their selector labels. */}}
{{- define "nibble.metaLabels" -}}
helm.sh/chart: {{ include "nibble.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: nibble
{{- end -}}

{{- define "nibble.labels" -}}
{{ include "nibble.metaLabels" . }}
app.kubernetes.io/name: {{ include "nibble.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "nibble.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nibble.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Pods that run a Ray node (metrics agent on 8080): Ray pods and, when disaggregated, the gateway. */}}
{{- define "nibble.rayNodeLabel" -}}
nibble.io/ray-node: "true"
{{- end -}}

{{/* Flags and redis -------------------------------------------------------------------- */}}

{{/* A scalar as a command-line argument: whole numbers without exponent (1e+06 -> 1000000). */}}
{{- define "nibble.scalar" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{- define "nibble.chartRedis" -}}
{{- if and .Values.hierarchicalCache.enabled (eq .Values.hierarchicalCache.storage "redis") (not .Values.redis.external.url) -}}
true
{{- end -}}
{{- end -}}

{{- define "nibble.redisUrl" -}}
{{- printf "redis://%s-redis.%s.svc.%s:6379/0" (include "nibble.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* serve.args: one `nibble serve` argument per line. */}}
{{- define "nibble.serveArgs" -}}
--host
0.0.0.0
--port
{{ .Values.gateway.httpPort }}
{{- if .Values.gateway.grpc.enabled }}
--grpc-port
{{ .Values.gateway.grpc.port }}
{{- end }}
{{- if .Values.disaggregation.enabled }}
--disaggregate
--prefill-workers
{{ .Values.ray.prefill.replicas }}
--decode-workers
{{ .Values.ray.decode.replicas }}
--ray-address
{{ include "nibble.rayHeadAddress" . }}
{{- if not (kindIs "invalid" (index .Values.serve.flags "tp-size")) }}
{{- fail "serve.flags.tp-size sizes the colocated engine; with disaggregation.enabled set ray.prefill.tpSize and ray.decode.tpSize" }}
{{- end }}
{{- if eq (int .Values.ray.prefill.tpSize) (int .Values.ray.decode.tpSize) }}
--tp-size
{{ .Values.ray.prefill.tpSize }}
{{- else }}
--prefill-tp-size
{{ .Values.ray.prefill.tpSize }}
--decode-tp-size
{{ .Values.ray.decode.tpSize }}
{{- end }}
{{- end }}
{{- if .Values.hierarchicalCache.enabled }}
--enable-hierarchical-cache
--hicache-storage-backend
{{ .Values.hierarchicalCache.storage }}
{{- if include "nibble.chartRedis" . }}
--hicache-storage-url
{{ include "nibble.redisUrl" . }}
{{- end }}
{{- end }}
--kv-secret-file
{{ include "nibble.secretsDir" . }}/kv-secret
--graceful-shutdown-timeout
{{ max 0 (sub (int .Values.gateway.terminationGracePeriodSeconds) 5) }}
{{- if .Values.auth.allowUnauthenticated }}
--allow-unauthenticated
{{- end }}
{{- with .Values.gateway.tls }}
{{- if .secretName }}
--ssl-certfile
{{ include "nibble.tlsDir" $ }}/tls.crt
--ssl-keyfile
{{ include "nibble.tlsDir" $ }}/tls.key
{{- if .requireClientCertificates }}
--ssl-ca-certs
{{ include "nibble.tlsDir" $ }}/ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.disaggregation.enabled .Values.ray.transferTls.secretName }}
--kv-transfer-ssl-certfile
{{ include "nibble.transferTlsDir" . }}/tls.crt
--kv-transfer-ssl-keyfile
{{ include "nibble.transferTlsDir" . }}/tls.key
--kv-transfer-ssl-ca-certs
{{ include "nibble.transferTlsDir" . }}/ca.crt
{{- end }}
{{- range $flag := keys .Values.serve.flags | sortAlpha }}
{{- $v := index $.Values.serve.flags $flag }}
{{- if kindIs "bool" $v }}
{{- if $v }}
--{{ $flag }}
{{- end }}
{{- else if not (kindIs "invalid" $v) }}
--{{ $flag }}
{{ include "nibble.scalar" $v }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ray-start.args: the gateway joins the cluster as a Ray node that runs no actor. */}}
{{- define "nibble.gatewayRayStartArgs" -}}
--address={{ include "nibble.rayHeadAddress" . }}
--num-cpus=0
--num-gpus=0
--object-store-memory={{ include "nibble.scalar" .Values.gateway.rayObjectStoreBytes }}
--metrics-export-port=8080
--disable-usage-stats
{{- end -}}

{{/* Pod pieces shared by the gateway and the Ray pods ----------------------------------- */}}

{{- define "nibble.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.scratch.homeSizeLimit }}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "nibble.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/nibble
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "nibble.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSize }}
{{- end -}}

{{/* Secrets reach every process as files (--kv-secret-file, ...), never env or argv. */}}
{{- define "nibble.secretsDir" -}}/etc/nibble/secrets{{- end -}}
{{- define "nibble.tlsDir" -}}/etc/nibble/tls{{- end -}}
{{- define "nibble.transferTlsDir" -}}/etc/nibble/transfer-tls{{- end -}}

{{/* The Ray pods get only what the workers read: the KV secret and the Redis password. */}}
{{- define "nibble.workerSecretVolumes" -}}
- name: secrets
  secret:
    secretName: {{ include "nibble.secretName" . }}
    defaultMode: 0400
    # redis-password exists only with a Redis L3 tier.
    optional: true
    items:
      - key: kv-secret
        path: kv-secret
      - key: redis-password
        path: redis-password
{{- with .Values.ray.transferTls.secretName }}
- name: transfer-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0400
{{- end }}
{{- end -}}

{{- define "nibble.workerSecretMounts" -}}
- name: secrets
  mountPath: {{ include "nibble.secretsDir" . }}
  readOnly: true
{{- if .Values.ray.transferTls.secretName }}
- name: transfer-tls
  mountPath: {{ include "nibble.transferTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "nibble.commonEnv" -}}
- name: HOME
  value: /home/nibble
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- end -}}

{{/* The gateway's /health probe: HTTPS when it serves TLS; a TCP check when it also demands
client certificates (the kubelet has none). */}}
{{- define "nibble.healthProbe" -}}
{{- $tls := .Values.gateway.tls -}}
{{- if and $tls.secretName $tls.requireClientCertificates -}}
tcpSocket:
  port: http
{{- else -}}
httpGet:
  path: /health
  port: http
  {{- if $tls.secretName }}
  scheme: HTTPS
  {{- end }}
{{- end -}}
{{- end -}}

{{/* NetworkPolicy peers: the pods of this release (gateway, Ray head and workers). */}}
{{- define "nibble.releasePeers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "nibble.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: [gateway, ray-head, ray-prefill, ray-decode]
{{- end -}}
