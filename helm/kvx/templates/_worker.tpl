{{/*
The pod of a prefill or decode worker, for a StatefulSet or a
LeaderWorkerSet's leader: (dict "ctx" $ "role" "prefill").
*/}}

{{- define "kvx.worker.rdmaIpcLock" -}}
{{- if ne .Values.rdma.mode "none" }}true{{ end -}}
{{- end -}}

{{- define "kvx.worker.startupFailures" -}}
{{- $w := .Values.workers -}}
{{- $timeout := int $w.startupTimeoutS -}}
{{- if eq $timeout 0 -}}
{{- $timeout = ternary 300 1800 (eq $w.engine "synthetic") -}}
{{- end -}}
{{- div (add $timeout 9) 10 -}}
{{- end -}}

{{- define "kvx.worker.podAnnotations" -}}
{{- $ctx := .ctx -}}
checksum/secret: {{ include "kvx.secretChecksum" $ctx }}
{{- if and (eq $ctx.Values.rdma.mode "devicePlugin") $ctx.Values.rdma.devicePlugin.networks }}
k8s.v1.cni.cncf.io/networks: {{ $ctx.Values.rdma.devicePlugin.networks | quote }}
{{- end }}
{{- with $ctx.Values.workers.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvx.worker.podSpec" -}}
{{- $ctx := .ctx -}}
{{- $role := .role -}}
{{- $v := $ctx.Values -}}
{{- $w := $v.workers -}}
{{- $r := get $w $role -}}
{{- $secretDir := include "kvx.secretDir" $ctx -}}
{{- $mode := $v.rdma.mode -}}
{{- $hostNetwork := eq $mode "hostNetwork" -}}
{{- $privileged := and $hostNetwork $v.rdma.hostNetwork.privileged -}}
{{- $engineArgs := concat $w.engineArgs $r.engineArgs -}}
automountServiceAccountToken: false
# The preStop drain may take drainTimeoutS; the margin covers the daemon's
# own shutdown after it.
terminationGracePeriodSeconds: {{ add $w.drainTimeoutS $w.terminationGraceMarginS }}
securityContext:
  {{- include "kvx.podSecurityContext" $ctx | nindent 2 }}
{{- if $hostNetwork }}
hostNetwork: true
# Service names (the metadata service) still resolve through the cluster DNS.
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if eq $mode "dra" }}
resourceClaims:
  - name: rdma
    resourceClaimTemplateName: {{ include "kvx.fullname" $ctx }}-rdma
{{- end }}
containers:
  - name: {{ $role }}
    image: {{ include "kvx.workerImage" $ctx }}
    imagePullPolicy: {{ include "kvx.workerPullPolicy" $ctx }}
    {{- if .follower }}
    command:
      {{- toYaml $w.leaderWorkerSet.workerCommand | nindent 6 }}
    {{- else }}
    command: ["kvx", {{ $role | quote }}]
    {{- end }}
    {{- if and $engineArgs (not .follower) }}
    args:
      - "--"
      {{- range $engineArgs }}
      - {{ . | quote }}
      {{- end }}
    {{- end }}
    env:
      # Every daemon option is a KVX_* variable (kvx prefill --help).
      - name: KVX_NAME
        valueFrom:
          fieldRef: {fieldPath: metadata.name}
      - name: KVX_ADVERTISE_HOST
        valueFrom:
          fieldRef: {fieldPath: status.podIP}
      - name: KVX_HOST
        value: "0.0.0.0"
      - name: KVX_ENGINE
        value: {{ $w.engine | quote }}
      - name: KVX_METADATA
        value: {{ include "kvx.metadataAddress" $ctx | quote }}
      {{- /* SGLang's agents find their peers through its bootstrap server, not here. */}}
      {{- if and (gt (int $ctx.Values.metadata.readReplicas) 0) (ne $w.engine "sglang") }}
      - name: KVX_METADATA_READ
        value: {{ include "kvx.metadataReadAddress" $ctx | quote }}
      {{- end }}
      - name: KVX_METADATA_TOKEN_FILE
        value: {{ $secretDir }}/metadata-token
      - name: KVX_SECRET_FILE
        value: {{ $secretDir }}/cluster-secret
      - name: KVX_ADMIN_TOKEN_FILE
        value: {{ $secretDir }}/admin-token
      - name: KVX_API_PORT
        value: {{ $r.apiPort | quote }}
      - name: KVX_ADMIN_PORT
        value: {{ $r.adminPort | quote }}
      - name: KVX_AGENT_PORT
        value: {{ $r.agentPort | quote }}
      - name: KVX_DRAIN_TIMEOUT_S
        value: {{ $w.drainTimeoutS | quote }}
      - name: KVX_LEASE_S
        value: {{ $w.leaseS | quote }}
      - name: KVX_BACKEND
        value: {{ $w.backend | quote }}
      {{- if eq $w.engine "synthetic" }}
      - name: KVX_MODEL_SHAPE
        value: {{ $w.modelShape | quote }}
      - name: KVX_NUM_BLOCKS
        value: {{ $w.numBlocks | quote }}
      - name: KVX_PREFILL_TOKENS_PER_S
        value: {{ $w.prefillTokensPerS | quote }}
      {{- end }}
      # Caches and downloads (HOME, Hugging Face, Triton, vLLM) go to /cache.
      - name: HOME
        value: /cache
      - name: XDG_CACHE_HOME
        value: /cache/.cache
      - name: HF_HOME
        value: /cache/huggingface
      {{- with $w.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if not .follower }}
    ports:
      - name: api
        containerPort: {{ $r.apiPort }}
        protocol: TCP
      - name: admin
        containerPort: {{ $r.adminPort }}
        protocol: TCP
      - name: agent
        containerPort: {{ $r.agentPort }}
        protocol: TCP
    startupProbe:
      httpGet: {path: /readyz, port: admin}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: {{ include "kvx.worker.startupFailures" $ctx }}
    livenessProbe:
      httpGet: {path: /healthz, port: admin}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    readinessProbe:
      httpGet: {path: /readyz, port: admin}
      periodSeconds: 5
      timeoutSeconds: 5
      failureThreshold: 2
    lifecycle:
      preStop:
        exec:
          command:
            - kvx
            - drain
            - --admin
            - http://127.0.0.1:{{ $r.adminPort }}
            - --token-file
            - {{ $secretDir }}/admin-token
            - --wait
            - --timeout-s
            - {{ $w.drainTimeoutS | quote }}
    {{- end }}
    securityContext:
      {{- include "kvx.containerSecurityContext" (dict "readOnly" $w.readOnlyRootFilesystem "ipcLock" (ne $mode "none") "privileged" $privileged) | nindent 6 }}
    resources:
      {{- $res := deepCopy $r.resources }}
      {{- $limits := default dict $res.limits }}
      {{- $requests := default dict $res.requests }}
      {{- if gt (int $r.gpus) 0 }}
      {{- $_ := set $limits $w.gpuResourceName (int $r.gpus) }}
      {{- $_ := set $requests $w.gpuResourceName (int $r.gpus) }}
      {{- end }}
      {{- if eq $mode "devicePlugin" }}
      {{- $_ := set $limits $v.rdma.devicePlugin.resourceName (int $v.rdma.devicePlugin.count) }}
      {{- $_ := set $requests $v.rdma.devicePlugin.resourceName (int $v.rdma.devicePlugin.count) }}
      {{- end }}
      {{- with $requests }}
      requests:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $limits }}
      limits:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if eq $mode "dra" }}
      claims:
        - name: rdma
      {{- end }}
    volumeMounts:
      - name: secrets
        mountPath: {{ $secretDir }}
        readOnly: true
      - name: dshm
        mountPath: /dev/shm
      - name: tmp
        mountPath: /tmp
      - name: cache
        mountPath: /cache
      {{- if $hostNetwork }}
      - name: infiniband
        mountPath: /dev/infiniband
      {{- end }}
      {{- with $w.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  {{- include "kvx.secretVolume" (dict "ctx" $ctx "keys" (list "cluster-secret" "admin-token" "metadata-token")) | nindent 2 }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $w.shmSizeLimit }}
  - name: tmp
    emptyDir:
      sizeLimit: 1Gi
  - name: cache
    {{- toYaml $w.cacheVolume | nindent 4 }}
  {{- if $hostNetwork }}
  - name: infiniband
    hostPath:
      path: /dev/infiniband
      type: Directory
  {{- end }}
  {{- with $w.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $r.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $r.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $r.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
