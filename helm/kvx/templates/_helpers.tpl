{{/* Names, labels and the pieces the workloads share. */}}

{{- define "kvx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Leaves room for the longest suffix ("-metadata-admin", pod ordinals). */}}
{{- define "kvx.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvx.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "metadata"). */}}
{{- define "kvx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvx.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvx.labels" -}}
helm.sh/chart: {{ include "kvx.chart" .ctx }}
{{ include "kvx.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvx
{{- end -}}

{{/* Every pod of this release carries these: the NetworkPolicy admits them. */}}
{{- define "kvx.releaseSelector" -}}
app.kubernetes.io/name: {{ include "kvx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvx.secretName" -}}
{{- default (printf "%s-secret" (include "kvx.fullname" .)) .Values.secret.existingSecret -}}
{{- end -}}

{{- define "kvx.metadataAddress" -}}
{{- printf "%s-metadata:%d" (include "kvx.fullname" .) (int .Values.metadata.grpcPort) -}}
{{- end -}}

{{/* HOST:PORT of the read replicas' Service (metadata.readReplicas > 0). */}}
{{- define "kvx.metadataReadAddress" -}}
{{- printf "%s-metadata-read:%d" (include "kvx.fullname" .) (int .Values.metadata.grpcPort) -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given (it wins). */}}
{{- define "kvx.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (toString (default .ctx.Chart.AppVersion .image.tag)) -}}
{{- end -}}
{{- end -}}

{{/* The workers' image: workers.image, else vllmImage for vllm, else image. */}}
{{- define "kvx.workerImage" -}}
{{- $w := .Values.workers -}}
{{- if $w.image.repository -}}
{{- include "kvx.image" (dict "ctx" . "image" $w.image) -}}
{{- else if eq $w.engine "vllm" -}}
{{- include "kvx.image" (dict "ctx" . "image" .Values.vllmImage) -}}
{{- else if eq $w.engine "sglang" -}}
{{- fail "workers.engine=sglang needs workers.image.repository: an image with SGLang and kvx installed (kvx ships none)" -}}
{{- else -}}
{{- include "kvx.image" (dict "ctx" . "image" .Values.image) -}}
{{- end -}}
{{- end -}}

{{- define "kvx.workerPullPolicy" -}}
{{- $w := .Values.workers -}}
{{- if $w.image.repository -}}{{ $w.image.pullPolicy }}
{{- else if eq $w.engine "vllm" -}}{{ .Values.vllmImage.pullPolicy }}
{{- else -}}{{ .Values.image.pullPolicy }}
{{- end -}}
{{- end -}}

{{- define "kvx.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A container's securityContext: (dict "readOnly" bool "ipcLock" bool "privileged" bool). */}}
{{- define "kvx.containerSecurityContext" -}}
{{- if .privileged -}}
privileged: true
allowPrivilegeEscalation: true
{{- else -}}
allowPrivilegeEscalation: false
privileged: false
{{- end }}
readOnlyRootFilesystem: {{ .readOnly }}
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
  {{- if .ipcLock }}
  add: ["IPC_LOCK"]
  {{- end }}
{{- end -}}

{{/* The Secret's keys mounted as files: (dict "ctx" $ "keys" (list ...)). */}}
{{- define "kvx.secretVolume" -}}
- name: secrets
  secret:
    secretName: {{ include "kvx.secretName" .ctx }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end -}}

{{/*
Rolls the pods when the secret values given change. Generated values are not
in it: they never change (lookup keeps them), and a checksum of a render of
secret.yaml would hash fresh random values, different from the Secret's,
and roll every pod at the first upgrade.
*/}}
{{- define "kvx.secretChecksum" -}}
{{- toJson .Values.secret | sha256sum -}}
{{- end -}}

{{- define "kvx.secretDir" -}}/etc/kvx/secrets{{- end -}}

{{- define "kvx.etcdStoreUrl" -}}
{{- $e := .Values.etcd -}}
{{- if $e.deploy.enabled -}}
{{- $name := printf "%s-etcd" (include "kvx.fullname" .) -}}
{{- $eps := list -}}
{{- range $i := until (int $e.deploy.replicas) -}}
{{- $eps = append $eps (printf "%s-%d.%s:%d" $name $i $name (int $e.deploy.clientPort)) -}}
{{- end -}}
etcd://{{ join "," $eps }}
{{- else -}}
etcd://{{ join "," $e.external.endpoints }}
{{- end -}}
{{- end -}}

{{/* Settings that cannot be checked by the schema alone. */}}
{{- define "kvx.validate" -}}
{{- $v := .Values -}}
{{- if eq $v.metadata.store "memory" -}}
{{- if gt (int $v.metadata.replicas) 1 -}}
{{- fail "metadata.replicas > 1 needs metadata.store=etcd: each replica of the memory store would hold its own agents" -}}
{{- end -}}
{{- if or $v.etcd.deploy.enabled $v.etcd.external.endpoints -}}
{{- fail "etcd is configured but metadata.store is memory: set metadata.store=etcd" -}}
{{- end -}}
{{- else -}}
{{- if gt (int $v.metadata.readReplicas) 0 -}}
{{- fail "metadata.readReplicas copies the memory store; with metadata.store=etcd the replicas share etcd already: raise metadata.replicas instead" -}}
{{- end -}}
{{- if and $v.etcd.deploy.enabled $v.etcd.external.endpoints -}}
{{- fail "set either etcd.deploy.enabled or etcd.external.endpoints, not both" -}}
{{- end -}}
{{- if not (or $v.etcd.deploy.enabled $v.etcd.external.endpoints) -}}
{{- fail "metadata.store=etcd needs etcd.external.endpoints or etcd.deploy.enabled=true" -}}
{{- end -}}
{{- end -}}
{{- if eq $v.rdma.mode "dra" -}}
{{- $need := get (dict "resource.k8s.io/v1" "1.34.0" "resource.k8s.io/v1beta2" "1.33.0" "resource.k8s.io/v1beta1" "1.32.0") $v.rdma.dra.apiVersion -}}
{{- if not (semverCompare (printf ">=%s-0" $need) .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "rdma.mode=dra with %s needs Kubernetes %s or newer (this is %s); pick rdma.dra.apiVersion to match the cluster" $v.rdma.dra.apiVersion $need .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $v.rdma.mode "dra") (not $v.rdma.dra.deviceClassName) -}}
{{- fail "rdma.mode=dra needs rdma.dra.deviceClassName: the DeviceClass of the RDMA devices" -}}
{{- end -}}
{{- if and (eq $v.workers.kind "leaderworkerset") (gt (int $v.workers.leaderWorkerSet.size) 1) (not $v.workers.leaderWorkerSet.workerCommand) -}}
{{- fail "workers.leaderWorkerSet.size > 1 needs workers.leaderWorkerSet.workerCommand: what the non-leader pods run" -}}
{{- end -}}
{{- end -}}
