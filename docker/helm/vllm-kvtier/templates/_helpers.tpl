{{/* Names and labels. */}}
{{- define "vllm-kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-kvtier.fullname" -}}
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

{{- define "vllm-kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vllm-kvtier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "vllm-kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: vllm-kvtier
{{- end -}}

{{- define "vllm-kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vllm-kvtier.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The components to deploy, as a JSON list of {name, role, replicas, resources, extraArgs,
extraConfig}: one "engine", or "prefill" and "decode" with pd.enabled.
*/}}
{{- define "vllm-kvtier.components" -}}
{{- $v := .Values -}}
{{- $out := list -}}
{{- if $v.pd.enabled -}}
{{- range $name := list "prefill" "decode" -}}
{{- $c := index $v.pd $name -}}
{{- $out = append $out (dict "name" $name "role" $c.role "replicas" $c.replicas
      "resources" (default $v.resources $c.resources) "extraArgs" (default list $c.extraArgs)
      "extraConfig" (default dict $c.extraConfig)) -}}
{{- end -}}
{{- else -}}
{{- $out = append $out (dict "name" "engine" "role" $v.kvtier.role "replicas" $v.replicaCount
      "resources" $v.resources "extraArgs" list "extraConfig" dict) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Name of a component's Deployment and Service: <fullname> or <fullname>-<component>. */}}
{{- define "vllm-kvtier.componentName" -}}
{{- if eq .component "engine" -}}
{{- include "vllm-kvtier.fullname" .root -}}
{{- else -}}
{{- printf "%s-%s" (include "vllm-kvtier.fullname" .root | trunc 55 | trimSuffix "-") .component -}}
{{- end -}}
{{- end -}}

{{/* Copy a mapping without null values and without empty strings (both mean "plugin default"). */}}
{{- define "vllm-kvtier.compact" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if not (or (kindIs "invalid" $v) (and (kindIs "string" $v) (eq $v ""))) -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
Bytes in a Kubernetes quantity ("96Gi", "100G", "34359738368"), or "" when it has a form
this helper does not read (then the checks that use it are skipped).
*/}}
{{- define "vllm-kvtier.quantityBytes" -}}
{{- $q := toString . -}}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 -}}
{{- $digits := regexFind "^[0-9]+" $q -}}
{{- $suffix := trimPrefix $digits $q -}}
{{- if and $digits (hasKey $units $suffix) -}}
{{- mul (atoi $digits) (get $units $suffix) -}}
{{- end -}}
{{- end -}}

{{/*
kv_connector_extra_config for one component, as JSON. Input: dict "root" $ "component" $c.
Fails with the value to fix when the tier settings cannot work.
*/}}
{{- define "vllm-kvtier.extraConfig" -}}
{{- $kv := .root.Values.kvtier -}}
{{- $extra := dict -}}
{{- with $kv.preset -}}{{- $_ := set $extra "preset" . -}}{{- end -}}
{{- $cpu := include "vllm-kvtier.compact" $kv.cpu | fromJson -}}
{{- if and (hasKey $cpu "capacity_bytes") (hasKey $cpu "capacity_fraction") -}}
{{- fail "kvtier.cpu: set capacity_bytes or capacity_fraction, not both (set the other to null)" -}}
{{- end -}}
{{- if $cpu -}}{{- $_ := set $extra "cpu" $cpu -}}{{- end -}}
{{- if $kv.nvme.enabled -}}
{{- $nvme := include "vllm-kvtier.compact" (omit $kv.nvme "enabled" "volume") | fromJson -}}
{{- $_ := required "kvtier.nvme.capacity_bytes is required when kvtier.nvme.enabled" $nvme.capacity_bytes -}}
{{- $_ := required "kvtier.nvme.path is required when kvtier.nvme.enabled" $nvme.path -}}
{{- $_ := set $extra "nvme" $nvme -}}
{{- end -}}
{{- if $kv.s3.enabled -}}
{{- $s3 := include "vllm-kvtier.compact" (omit $kv.s3 "enabled" "credentials") | fromJson -}}
{{- $_ := required "kvtier.s3.bucket is required when kvtier.s3.enabled" $s3.bucket -}}
{{- $_ := set $extra "s3" $s3 -}}
{{- end -}}
{{- if $kv.mooncake.enabled -}}
{{- $mc := include "vllm-kvtier.compact" (omit $kv.mooncake "enabled") | fromJson -}}
{{- $_ := required "kvtier.mooncake.master (host:port of mooncake_master) is required when kvtier.mooncake.enabled" $mc.master -}}
{{- $_ := set $extra "mooncake" $mc -}}
{{- end -}}
{{- with $kv.auth -}}{{- if .existingSecret -}}
{{- $auth := dict "required" .required "local_tiers" .local_tiers -}}
{{- if .verifyKeys -}}
{{- $envs := list -}}
{{- range $i, $_ := .verifyKeys -}}{{- $envs = append $envs (printf "KVTIER_AUTH_VERIFY_KEY_%d" $i) -}}{{- end -}}
{{- $_ := set $auth "verify_key_envs" $envs -}}
{{- end -}}
{{- $_ := set $extra "auth" $auth -}}
{{- end -}}{{- end -}}
{{- $extra = mergeOverwrite $extra (deepCopy (default dict $kv.extraConfig)) (deepCopy .component.extraConfig) -}}
{{- toJson $extra -}}
{{- end -}}

{{/* The whole --kv-transfer-config JSON for one component. Input: dict "root" $ "component" $c. */}}
{{- define "vllm-kvtier.kvTransferConfig" -}}
{{- $kv := .root.Values.kvtier -}}
{{- $cfg := dict "kv_connector" $kv.connector "kv_role" .component.role
      "kv_load_failure_policy" $kv.loadFailurePolicy
      "kv_connector_extra_config" (include "vllm-kvtier.extraConfig" . | fromJson) -}}
{{- with $kv.connectorModulePath -}}{{- $_ := set $cfg "kv_connector_module_path" . -}}{{- end -}}
{{- toJson $cfg -}}
{{- end -}}
