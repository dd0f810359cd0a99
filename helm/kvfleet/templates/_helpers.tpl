{{/* Names and labels. */}}
{{- define "kvfleet.fullname" -}}
{{- printf "%s-kvfleet" .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "kvfleet.selector" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The worker roles the mode runs, one a line. */}}
{{- define "kvfleet.roles" -}}
{{- if eq .Values.mode "disagg" }}
- prefill
- decode
{{- else if eq .Values.mode "colocated" }}
- mixed
{{- else }}
- mixed
- prefill
- decode
{{- end }}
{{- end -}}

{{- define "kvfleet.secretName" -}}{{ include "kvfleet.fullname" . }}-secrets{{- end -}}
{{- define "kvfleet.fleetTokenSecret" -}}{{ .Values.fleetToken.existingSecret | default (include "kvfleet.secretName" .) }}{{- end -}}
{{- define "kvfleet.redisSecret" -}}{{ .Values.redis.existingSecret | default (include "kvfleet.secretName" .) }}{{- end -}}
{{- define "kvfleet.apiKeysSecret" -}}{{ .Values.apiKeys.existingSecret | default (include "kvfleet.secretName" .) }}{{- end -}}
{{- define "kvfleet.redisHost" -}}{{ include "kvfleet.fullname" . }}-redis{{- end -}}
{{- define "kvfleet.routerAddress" -}}{{ include "kvfleet.fullname" . }}-router:{{ .Values.ports.router }}{{- end -}}

{{/* A secret value kept across upgrades, in plain text: the given value, else the release's
     Secret's (lookup; empty when rendered offline), else a fresh random one.
     Call with (list $ "key" value). */}}
{{- define "kvfleet.kept" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}{{- $given := index . 2 -}}
{{- $old := lookup "v1" "Secret" $root.Release.Namespace (include "kvfleet.secretName" $root) -}}
{{- if $given -}}{{ $given }}
{{- else if and $old (hasKey ($old.data | default dict) $key) -}}{{ index $old.data $key | b64dec }}
{{- else -}}{{ randAlphaNum 40 }}
{{- end -}}
{{- end -}}

{{- define "kvfleet.image" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* Environment every kvfleet container has: its pod IP, the Redis URL, the fleet token's file
     (services/protocol/env.py), tracing. */}}
{{- define "kvfleet.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.redisSecret" . }}
      key: redis-url
- name: KVFLEET_FLEET_TOKEN_FILE
  value: /var/run/kvfleet/fleet-token/token
{{- if .Values.otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otlp.endpoint | quote }}
{{- end }}
{{- end -}}

{{/* The fleet token as a file every kvfleet process reads (KVFLEET_FLEET_TOKEN_FILE). */}}
{{- define "kvfleet.tokenMount" -}}
- name: fleet-token
  mountPath: /var/run/kvfleet/fleet-token
  readOnly: true
{{- end -}}
{{- define "kvfleet.tokenVolume" -}}
- name: fleet-token
  secret:
    secretName: {{ include "kvfleet.fleetTokenSecret" . }}
    items:
      - key: fleet-token
        path: token
{{- end -}}

{{- define "kvfleet.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
{{- end -}}
{{- define "kvfleet.modelVolume" -}}
- name: model
{{ toYaml .Values.model.volume | indent 2 }}
{{- end -}}

{{- define "kvfleet.engineConfigFlag" -}}
{{- if .Values.engine.configMap -}}
- --config=/etc/kvfleet/engine/engine.yaml
{{- end }}
{{- end -}}
{{- define "kvfleet.engineConfigMount" -}}
{{- if .Values.engine.configMap -}}
- name: engine-config
  mountPath: /etc/kvfleet/engine
  readOnly: true
{{- end }}
{{- end -}}
{{- define "kvfleet.engineConfigVolume" -}}
{{- if .Values.engine.configMap -}}
- name: engine-config
  configMap:
    name: {{ .Values.engine.configMap }}
{{- end }}
{{- end -}}

{{/* Scheduling every worker pod shares: node selector, tolerations, and the slice's topology
     affinity (one NVLink / IB domain for the slice's prefill and decode pods). */}}
{{- define "kvfleet.workerScheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
{{ toYaml . | indent 2 }}
{{- end }}
affinity:
  podAffinity:
    {{- $term := dict "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/instance" .Release.Name "kvfleet.io/slice" (toString .Values.topology.slice))) "topologyKey" .Values.topology.key }}
    {{- if .Values.topology.required }}
    requiredDuringSchedulingIgnoredDuringExecution:
      - {{ toYaml $term | indent 8 | trim }}
    {{- else }}
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          {{ toYaml $term | indent 10 | trim }}
    {{- end }}
{{- end -}}

{{/* The worker pools' workloads by kind, as the chart names them (kind: [names]): what
     `kvfleet rebalance --target kubernetes` patches, and all its Role may touch. */}}
{{- define "kvfleet.poolWorkloads" -}}
{{- $out := dict -}}
{{- range $role := include "kvfleet.roles" . | fromYamlArray -}}
{{- $pool := index $.Values.pools $role -}}
{{- $nodes := include "kvfleet.workerNodes" (dict "root" $ "role" $role "pool" $pool) | int -}}
{{- $kind := ternary "Deployment" "LeaderWorkerSet" (eq $nodes 1) -}}
{{- $_ := set $out $kind (append (get $out $kind | default list) (printf "%s-%s" (include "kvfleet.fullname" $) $role)) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The rebalancer's pod spec (after restartPolicy): call with
     (dict "root" $ "name" NAME "kind" KIND "mode" "--apply"|"--advisory"). */}}
{{- define "kvfleet.rebalancerPod" -}}
{{- $v := .root.Values.rebalancer -}}
serviceAccountName: {{ .name }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: rebalancer
    image: {{ printf "%s:%s" ($v.image.repository | default .root.Values.image.repository) ($v.image.tag | default .root.Values.image.tag) | quote }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    command: ["kvfleet"]
    args:
      - rebalance
      - --target=kubernetes
      - {{ .mode }}
      - --release={{ .root.Release.Name }}
      - --namespace={{ .root.Release.Namespace }}
      - --kube-kind={{ .kind }}
      - --redis-url=$(KVFLEET_REDIS_URL)
      - --window-s={{ $v.windowS }}
      - --audit-log=/var/lib/kvfleet/rebalance-audit.jsonl
      {{- range $v.args }}
      - {{ . | quote }}
      {{- end }}
    env:
      {{- include "kvfleet.env" .root | nindent 6 }}
    resources:
      {{- toYaml $v.resources | nindent 6 }}
    volumeMounts:
      {{- include "kvfleet.tokenMount" .root | nindent 6 }}
      - name: audit
        mountPath: /var/lib/kvfleet
volumes:
  {{- include "kvfleet.tokenVolume" .root | nindent 2 }}
  - name: audit
    emptyDir: {}
{{- end -}}
