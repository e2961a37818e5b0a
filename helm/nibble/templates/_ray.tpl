{{/*
The pod template of one Ray node group. Call with
(dict "ctx" $ "component" "ray-prefill" "container" "ray-worker" "group" .Values.ray.prefill "head" false).
KubeRay turns rayStartParams into `ray start` and runs it in the first container.
*/}}
{{- define "nibble.rayPodTemplate" -}}
{{- $ := .ctx -}}
{{- $grp := .group -}}
metadata:
  labels:
    {{- include "nibble.metaLabels" $ | nindent 4 }}
    {{- include "nibble.selectorLabels" (dict "ctx" $ "component" .component) | nindent 4 }}
    {{- include "nibble.rayNodeLabel" $ | nindent 4 }}
spec:
  serviceAccountName: {{ include "nibble.serviceAccountName" $ }}
  automountServiceAccountToken: false
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ .container }}
      image: {{ include "nibble.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      env:
        {{- include "nibble.commonEnv" $ | nindent 8 }}
        {{- with $.Values.ray.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- if .head }}
        - name: gcs-server
          containerPort: 6379
          protocol: TCP
        - name: dashboard
          containerPort: 8265
          protocol: TCP
        - name: client
          containerPort: 10001
          protocol: TCP
        {{- end }}
        - name: metrics
          containerPort: 8080
          protocol: TCP
      # Explicit HTTP probes on the dashboard agent (raylet, and the GCS on the head), so
      # KubeRay does not inject its exec probes.
      readinessProbe:
        httpGet:
          path: /api/healthz
          port: 52365
        initialDelaySeconds: 10
        periodSeconds: 5
        timeoutSeconds: 2
        failureThreshold: 10
      livenessProbe:
        httpGet:
          path: /api/healthz
          port: 52365
        initialDelaySeconds: 30
        periodSeconds: 10
        timeoutSeconds: 2
        failureThreshold: 12
      resources:
        {{- include "nibble.groupResources" $grp | nindent 8 }}
      securityContext:
        {{- toYaml $.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        {{- include "nibble.scratchMounts" $ | nindent 8 }}
        {{- include "nibble.workerSecretMounts" $ | nindent 8 }}
        - name: dshm
          mountPath: /dev/shm
  volumes:
    {{- include "nibble.scratchVolumes" $ | nindent 4 }}
    {{- include "nibble.workerSecretVolumes" $ | nindent 4 }}
    {{- include "nibble.shmVolume" $ | nindent 4 }}
  {{- with $grp.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $grp.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $grp.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
rayStartParams of a worker group: a custom resource naming its role, quoted the way KubeRay
passes it through the shell: '"{\"nibble_prefill\":1}"'. Call with (dict "role" "prefill" "group" ...).
*/}}
{{- define "nibble.workerRayStartParams" -}}
{{- $res := dict (printf "nibble_%s" .role) .group.customResource | toJson | replace "\"" "\\\"" -}}
{{- $params := dict "resources" (printf "\"%s\"" $res) "metrics-export-port" "8080" -}}
{{- toYaml (merge (deepCopy .group.rayStartParams) $params) -}}
{{- end -}}

{{/*
A Ray group's container resources: a worker group that asks for GPUs (nvidia.com/gpu in
requests or limits) asks for tpSize of them, one per tensor-parallel rank. Call with the group.
*/}}
{{- define "nibble.groupResources" -}}
{{- $res := deepCopy .resources -}}
{{- if .tpSize -}}
{{- range $kind := list "requests" "limits" -}}
{{- $m := index $res $kind | default dict -}}
{{- if hasKey $m "nvidia.com/gpu" -}}
{{- $_ := set $m "nvidia.com/gpu" (int $.tpSize) -}}
{{- $_ := set $res $kind $m -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
