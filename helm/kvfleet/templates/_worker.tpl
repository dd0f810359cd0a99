{{/* Worker pods. Call with (dict "root" $ "role" "prefill" "pool" $pool). */}}

{{- define "kvfleet.workerNodes" -}}
{{- $tp := int .pool.tensorParallel -}}{{- $per := int .pool.gpusPerNode -}}
{{- div (add $tp $per -1) $per -}}
{{- end -}}

{{- define "kvfleet.workerResources" -}}
{{- $root := .root -}}
{{- $gpus := min (int .pool.tensorParallel) (int .pool.gpusPerNode) -}}
{{- $extra := dict -}}
{{- if ne $root.Values.engine.device "cpu" }}{{ $_ := set $extra $root.Values.gpuResource $gpus }}{{ end -}}
{{- if $root.Values.rdma.enabled }}{{ $_ := set $extra $root.Values.rdma.resourceName $root.Values.rdma.perPod }}{{ end -}}
requests:
  {{- toYaml (merge (deepCopy $extra) (.pool.resources.requests | default dict)) | nindent 2 }}
limits:
  {{- toYaml (merge (deepCopy $extra) (.pool.resources.limits | default dict)) | nindent 2 }}
{{- end -}}

{{- define "kvfleet.workerLabels" -}}
{{ include "kvfleet.labels" .root }}
app.kubernetes.io/component: {{ .role }}
kvfleet.io/slice: {{ .root.Values.topology.slice | toString | quote }}
{{- end -}}

{{/* The engine core's flags, as `kvfleet serve ROLE` takes them. */}}
{{- define "kvfleet.workerArgs" -}}
{{- $v := .root.Values -}}
- serve
- {{ .role }}
- --model={{ $v.model.path }}
- --host=$(POD_IP)
- --allow-external-bind
- --port={{ $v.ports.worker }}
- --kv-port={{ $v.ports.kv }}
- --metrics-port={{ $v.ports.metrics }}
- --kv-backend={{ $v.engine.kvBackend }}
- --worker-id=$(POD_NAME)
- --redis-url=$(KVFLEET_REDIS_URL)
- --tensor-parallel={{ .pool.tensorParallel }}
- --device={{ $v.engine.device }}
{{- with $v.engine.kvCacheDtype }}
- --kv-cache-dtype={{ . }}
{{- end }}
{{- if eq $v.engine.kind "sim" }}
- --engine=sim
{{- with $v.engine.sim.model }}
- --sim-model={{ . }}
{{- end }}
{{- with $v.engine.sim.gpu }}
- --sim-gpu={{ . }}
{{- end }}
{{- end }}
{{- if .root.Values.engine.configMap }}
{{ include "kvfleet.engineConfigFlag" .root }}
{{- end }}
{{- end -}}

{{/* A worker pod's spec: the kvfleet worker (the leader, where the replica spans nodes). */}}
{{- define "kvfleet.workerPodSpec" -}}
{{- $root := .root -}}{{- $v := $root.Values -}}
terminationGracePeriodSeconds: {{ $v.drain.terminationGracePeriodSeconds }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "kvfleet.workerScheduling" $root }}
containers:
  - name: worker
    {{- include "kvfleet.image" $root | nindent 4 }}
    command: ["kvfleet"]
    args:
      {{- include "kvfleet.workerArgs" . | nindent 6 }}
    env:
      - name: POD_NAME
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
      {{- include "kvfleet.env" $root | nindent 6 }}
    ports:
      - name: grpc
        containerPort: {{ $v.ports.worker }}
      - name: kv
        containerPort: {{ $v.ports.kv }}
      - name: metrics
        containerPort: {{ $v.ports.metrics }}
    # SERVING once the model is loaded; NOT_SERVING from the start of a drain
    startupProbe:
      grpc: {port: {{ $v.ports.worker }}}
      periodSeconds: {{ $v.probes.startup.periodSeconds }}
      failureThreshold: {{ $v.probes.startup.failureThreshold }}
    readinessProbe:
      grpc: {port: {{ $v.ports.worker }}}
      periodSeconds: {{ $v.probes.readiness.periodSeconds }}
      failureThreshold: {{ $v.probes.readiness.failureThreshold }}
    # alive while it listens: a draining worker is NOT_SERVING but must not be restarted
    livenessProbe:
      tcpSocket: {port: grpc}
      periodSeconds: {{ $v.probes.liveness.periodSeconds }}
      failureThreshold: {{ $v.probes.liveness.failureThreshold }}
    lifecycle:
      preStop:
        exec:
          # SIGUSR1 drains (services/worker/drain.py): the worker leaves Redis, finishes what it
          # holds, then exits; the hook returns when it has, within the grace period
          command: ["/bin/sh", "-c", "kill -USR1 1; while kill -0 1 2>/dev/null; do sleep 1; done"]
    resources:
      {{- include "kvfleet.workerResources" . | nindent 6 }}
    volumeMounts:
      {{- include "kvfleet.modelMount" $root | nindent 6 }}
      {{- include "kvfleet.tokenMount" $root | nindent 6 }}
      {{- if $root.Values.engine.configMap }}{{ include "kvfleet.engineConfigMount" $root | nindent 6 }}{{ end }}
      - name: shm
        mountPath: /dev/shm
volumes:
  {{- include "kvfleet.modelVolume" $root | nindent 2 }}
  {{- include "kvfleet.tokenVolume" $root | nindent 2 }}
  {{- if $root.Values.engine.configMap }}{{ include "kvfleet.engineConfigVolume" $root | nindent 2 }}{{ end }}
  - name: shm
    emptyDir:
      medium: Memory
{{- end -}}

{{/* A follower pod of a replica spanning nodes: tensor-parallel ranks of its node. */}}
{{- define "kvfleet.followerPodSpec" -}}
{{- $root := .root -}}{{- $v := $root.Values -}}
terminationGracePeriodSeconds: {{ $v.drain.terminationGracePeriodSeconds }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "kvfleet.workerScheduling" $root }}
containers:
  - name: ranks
    {{- include "kvfleet.image" $root | nindent 4 }}
    command: ["python", "-m", "services.engine.tp_ranks"]
    args:
      - $(LWS_WORKER_INDEX)
      - {{ include "kvfleet.workerNodes" . | quote }}
      - /var/run/kvfleet/tp/store
      - --backend=nccl
    resources:
      {{- include "kvfleet.workerResources" . | nindent 6 }}
    volumeMounts:
      {{- include "kvfleet.modelMount" $root | nindent 6 }}
      - name: shm
        mountPath: /dev/shm
volumes:
  {{- include "kvfleet.modelVolume" $root | nindent 2 }}
  - name: shm
    emptyDir:
      medium: Memory
{{- end -}}
