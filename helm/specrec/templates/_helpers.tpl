{{/* ----------------------------------------------------------- names */}}

{{- define "specrec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specrec.fullname" -}}
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

{{/* <fullname>-<component>, e.g. specrec-verifier; args: (list $ "verifier") */}}
{{- define "specrec.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "specrec.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "specrec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* ---------------------------------------------------------- labels */}}

{{- define "specrec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specrec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specrec.labels" -}}
helm.sh/chart: {{ include "specrec.chart" . }}
{{ include "specrec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specrec
{{- end -}}

{{/* args: (list $ "component") */}}
{{- define "specrec.componentSelectorLabels" -}}
{{ include "specrec.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "specrec.componentLabels" -}}
{{ include "specrec.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* ---------------------------------------------------------- images */}}

{{- define "specrec.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "specrec.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "specrec.imageTag" .) -}}
{{- end -}}

{{- define "specrec.gpuImage" -}}
{{- $g := .Values.verifier.gpu.image -}}
{{- $repo := $g.repository | default .Values.image.repository -}}
{{- $tag := $g.tag | default (printf "%s-gpu" (include "specrec.imageTag" .)) -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "specrec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "specrec.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* ------------------------------------------------------- addresses */}}

{{/* gRPC address of a component's (headless) Service; args: (list $ "itemset").
     dns:/// makes the client resolve every pod address of the headless Service. */}}
{{- define "specrec.addr" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $port := int (index $root.Values $comp).port -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "specrec.componentName" (list $root $comp)) $root.Release.Namespace $root.Values.clusterDomain $port -}}
{{- end -}}

{{/* "true" when the gateway watches EndpointSlices: discovery "kubernetes", or its short name "k8s". */}}
{{- define "specrec.k8sDiscovery" -}}
{{- if has .Values.discovery (list "kubernetes" "k8s") -}}true{{- end -}}
{{- end -}}

{{/* Replica target of a component the gateway balances over (drafter, verifier); args: (list $ "drafter").
     discovery=kubernetes: k8s:<namespace>/<service>:grpc (EndpointSlices, by port name); else the dns address. */}}
{{- define "specrec.replicasAddr" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- if include "specrec.k8sDiscovery" $root -}}
{{- printf "k8s:%s/%s:grpc" $root.Release.Namespace (include "specrec.componentName" (list $root $comp)) -}}
{{- else -}}
{{- include "specrec.addr" . -}}
{{- end -}}
{{- end -}}

{{- define "specrec.redis.bundled" -}}
{{- if and (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) (not .Values.redis.sentinel.hosts) -}}true{{- end -}}
{{- end -}}

{{/* redis+sentinel:// URL of an external Sentinel-managed Redis (its passwords come from Secrets, apart) */}}
{{- define "specrec.redis.sentinelUrl" -}}
{{- $s := .Values.redis.sentinel -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret -}}
{{- fail "redis.sentinel.hosts and redis.external are two external Redis: set one" -}}
{{- end -}}
{{- if .Values.redis.external.cluster -}}
{{- fail "redis.sentinel.hosts cannot be combined with redis.external.cluster" -}}
{{- end -}}
{{- $hosts := list -}}
{{- range $s.hosts -}}
{{- $hosts = append $hosts (ternary . (printf "%s:26379" .) (contains ":" .)) -}}
{{- end -}}
{{- printf "%s://%s/%s/%d" (ternary "rediss+sentinel" "redis+sentinel" $s.tls) (join "," $hosts) $s.masterName (int $s.db) -}}
{{- end -}}

{{/* The bundled Redis requires a password (redis.auth.enabled; ignored with an external Redis). */}}
{{- define "specrec.redis.auth" -}}
{{- if and (include "specrec.redis.bundled" .) .Values.redis.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/* (name, key) of the Secret holding the bundled Redis's password, as a dict */}}
{{- define "specrec.redis.passwordRef" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- dict "name" .Values.redis.auth.existingSecret "key" .Values.redis.auth.existingSecretKey | toJson -}}
{{- else -}}
{{- dict "name" (include "specrec.fullname" .) "key" "redis-password" | toJson -}}
{{- end -}}
{{- end -}}

{{/* REDIS_PASSWORD from its Secret (before any variable that refers to it as $(REDIS_PASSWORD)) */}}
{{- define "specrec.env.redisPassword" -}}
{{- $ref := include "specrec.redis.passwordRef" . | fromJson -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ref.name }}
      key: {{ $ref.key }}
{{- end -}}

{{/* URL of the bundled Redis; with auth, the password comes from $(REDIS_PASSWORD)
     (Kubernetes expands it from the variable defined just before). */}}
{{- define "specrec.redis.url" -}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (eq (include "specrec.redis.auth" .) "true") -}}
{{- printf "redis://%s%s.%s.svc.%s:6379/0" $auth (include "specrec.componentName" (list . "redis")) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* The chart's own Secret is needed for a generated/given write token, an
     external Redis URL or a generated Redis password. */}}
{{- define "specrec.secret.needed" -}}
{{- $token := not .Values.writeToken.existingSecret -}}
{{- $url := and .Values.redis.external.url (not .Values.redis.external.existingSecret) -}}
{{- $pw := and (include "specrec.redis.auth" .) (not .Values.redis.auth.existingSecret) -}}
{{- if or $token $url $pw -}}true{{- end -}}
{{- end -}}

{{/* Redis URL env var of the item set and the loader */}}
{{- define "specrec.env.redis" -}}
{{- if .Values.redis.sentinel.hosts }}
- name: SPECREC_ITEMSET_REDIS_URL
  value: {{ include "specrec.redis.sentinelUrl" . | quote }}
{{- with .Values.redis.sentinel.existingSecret }}
- name: SPECREC_ITEMSET_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.sentinel.existingSecretKey }}
{{- end }}
{{- with .Values.redis.sentinel.sentinelExistingSecret }}
- name: SPECREC_ITEMSET_REDIS_SENTINEL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.sentinel.sentinelExistingSecretKey }}
{{- end }}
{{- else if .Values.redis.external.existingSecret }}
- name: SPECREC_ITEMSET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.external.url }}
- name: SPECREC_ITEMSET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "specrec.fullname" . }}
      key: redis-url
{{- else }}
{{- if include "specrec.redis.auth" . }}
{{ include "specrec.env.redisPassword" . }}
{{- end }}
- name: SPECREC_ITEMSET_REDIS_URL
  value: {{ include "specrec.redis.url" . | quote }}
{{- end }}
- name: SPECREC_ITEMSET_REDIS_CLUSTER
  value: {{ .Values.redis.external.cluster | toString | quote }}
- name: SPECREC_ITEMSET_NAMESPACE
  value: {{ .Values.itemset.namespace | quote }}
- name: SPECREC_ITEMSET_KEEP_VERSIONS
  value: {{ int .Values.itemset.keepVersions | quote }}
- name: SPECREC_ITEMSET_WRITE_REPLICAS
  value: {{ int .Values.itemset.writeReplicas | quote }}
{{- end -}}

{{/* ------------------------------------------------ environment (env) */}}

{{/* Settings every service shares; args: (list $ "itemset") */}}
{{- define "specrec.env.common" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- $c := $root.Values.common -}}
{{- $p := printf "SPECREC_%s_" (upper $comp) -}}
- name: {{ $p }}HOST
  value: "0.0.0.0"
- name: {{ $p }}PORT
  value: {{ int $v.port | quote }}
- name: {{ $p }}METRICS_PORT
  value: {{ int $v.metricsPort | quote }}
- name: {{ $p }}MAX_CONCURRENCY
  value: {{ int $v.maxConcurrency | quote }}
- name: {{ $p }}MAX_MESSAGE_MB
  value: {{ int $c.maxMessageMb | quote }}
- name: {{ $p }}KEEPALIVE_S
  value: {{ int $c.keepaliveS | quote }}
- name: {{ $p }}GRACE_S
  value: {{ $c.graceS | toString | quote }}
- name: {{ $p }}LOG_LEVEL
  value: {{ $c.logLevel | quote }}
- name: {{ $p }}LOG_JSON
  value: {{ $c.logJson | toString | quote }}
- name: {{ $p }}REFLECTION
  value: {{ $c.reflection | toString | quote }}
{{- end -}}

{{/* TLS settings when tls.secretName is set (the Secret mounted at /etc/specrec/tls); args: (list $ "drafter") */}}
{{- define "specrec.env.tls" -}}
{{- $root := index . 0 -}}
{{- $t := $root.Values.tls -}}
{{- if $t.secretName -}}
{{- $p := printf "SPECREC_%s_" (upper (index . 1)) -}}
- name: {{ $p }}TLS_CERT_FILE
  value: "/etc/specrec/tls/tls.crt"
- name: {{ $p }}TLS_KEY_FILE
  value: "/etc/specrec/tls/tls.key"
- name: {{ $p }}TLS_CA_FILE
  value: "/etc/specrec/tls/ca.crt"
- name: {{ $p }}TLS_REQUIRE_CLIENT_AUTH
  value: {{ $t.requireClientAuth | toString | quote }}
- name: {{ $p }}TLS_SERVER_NAME
  value: {{ $t.serverName | quote }}
{{- end -}}
{{- end -}}

{{/* A probe's handler: the gRPC health service of the component's port; with TLS (which kubelet
     gRPC probes cannot speak) the image's health check over TLS, run in the container. args: (list $ port) */}}
{{- define "specrec.probeHandler" -}}
{{- $root := index . 0 -}}
{{- $port := int (index . 1) -}}
{{- $t := $root.Values.tls -}}
{{- if $t.secretName -}}
exec:
  command:
    - python
    - -m
    - specrec_rpc.healthcheck
    - {{ printf "127.0.0.1:%d" $port | quote }}
    {{- include "specrec.healthcheckTlsArgs" $root | nindent 4 }}
{{- else -}}
grpc:
  port: {{ $port }}
{{- end -}}
{{- end -}}

{{/* healthcheck arguments for TLS (the mounted Secret; mTLS: the client certificate too) */}}
{{- define "specrec.healthcheckTlsArgs" -}}
{{- $t := .Values.tls -}}
{{- if $t.secretName -}}
- --tls-ca
- /etc/specrec/tls/ca.crt
{{- if $t.requireClientAuth }}
- --tls-cert
- /etc/specrec/tls/tls.crt
- --tls-key
- /etc/specrec/tls/tls.key
{{- end }}
- --server-name
- {{ $t.serverName | quote }}
{{- end -}}
{{- end -}}

{{/* Math-library threads following <component>.threads; args: (list $ "drafter") */}}
{{- define "specrec.env.threads" -}}
{{- $v := index (index . 0).Values (index . 1) -}}
- name: OMP_NUM_THREADS
  value: {{ int $v.threads | quote }}
- name: MKL_NUM_THREADS
  value: {{ int $v.threads | quote }}
{{- end -}}

{{/* <component>.config: {SETTING: value} -> SPECREC_<COMPONENT>_SETTING; args: (list $ "itemset") */}}
{{- define "specrec.env.config" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- range $k, $val := $v.config }}
- name: {{ printf "SPECREC_%s_%s" (upper $comp) (upper $k) }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- end -}}

{{- define "specrec.env.itemset" -}}
{{- $v := .Values.itemset -}}
{{ include "specrec.env.redis" . | trim }}
- name: SPECREC_ITEMSET_BUNDLE
  value: {{ .Values.bundle.path | quote }}
- name: SPECREC_ITEMSET_LOAD_IF_EMPTY
  value: {{ $v.loadIfEmpty | toString | quote }}
- name: SPECREC_ITEMSET_WARM_UP
  value: {{ $v.warmUp | toString | quote }}
- name: SPECREC_ITEMSET_REDIS_TIMEOUT_S
  value: {{ $v.redisTimeoutS | toString | quote }}
- name: SPECREC_ITEMSET_STARTUP_WAIT_S
  value: {{ $v.startupWaitS | toString | quote }}
- name: SPECREC_ITEMSET_WRITE_RETRY_S
  value: {{ $v.writeRetryS | toString | quote }}
- name: SPECREC_ITEMSET_WRITE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.writeToken.existingSecret | default (include "specrec.fullname" .) }}
      key: {{ ternary .Values.writeToken.existingSecretKey "write-token" (ne .Values.writeToken.existingSecret "") }}
{{- end -}}

{{- define "specrec.env.drafter" -}}
{{- $v := .Values.drafter -}}
- name: SPECREC_DRAFTER_BUNDLE
  value: {{ .Values.bundle.path | quote }}
- name: SPECREC_DRAFTER_ITEMSET_ADDR
  value: {{ include "specrec.addr" (list . "itemset") | quote }}
- name: SPECREC_DRAFTER_DEFAULT_MODE
  value: {{ $v.defaultMode | quote }}
- name: SPECREC_DRAFTER_THREADS
  value: {{ int $v.threads | quote }}
- name: SPECREC_DRAFTER_PROCESSES
  value: {{ int $v.processes | quote }}
- name: SPECREC_DRAFTER_MAX_N
  value: {{ int $v.maxN | quote }}
- name: SPECREC_DRAFTER_MAX_QUERIES
  value: {{ int $v.maxQueries | quote }}
- name: SPECREC_DRAFTER_MAX_HISTORY
  value: {{ int $v.maxHistory | quote }}
{{- end -}}

{{- define "specrec.env.verifier" -}}
{{- $v := .Values.verifier -}}
- name: SPECREC_VERIFIER_BUNDLE
  value: {{ .Values.bundle.path | quote }}
- name: SPECREC_VERIFIER_ITEMSET_ADDR
  value: {{ include "specrec.addr" (list . "itemset") | quote }}
{{- $backend := ternary $v.gpu.backend $v.backend $v.gpu.enabled }}
- name: SPECREC_VERIFIER_BACKEND
  value: {{ $backend | quote }}
- name: SPECREC_VERIFIER_DEVICE
  value: {{ ternary $v.gpu.device "cpu" $v.gpu.enabled | quote }}
{{- if eq $backend "cuda" }}
- name: SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES
  value: {{ $v.gpu.cudaGraphBatchSizes | toJson | quote }}
{{- end }}
{{- if $v.onnxDir }}
- name: SPECREC_VERIFIER_ONNX_DIR
  value: {{ $v.onnxDir | quote }}
{{- end }}
- name: SPECREC_VERIFIER_THREADS
  value: {{ int $v.threads | quote }}
- name: SPECREC_VERIFIER_MAX_BATCH
  value: {{ int $v.maxBatch | quote }}
- name: SPECREC_VERIFIER_SESSION_TTL_S
  value: {{ $v.sessionTtlS | toString | quote }}
- name: SPECREC_VERIFIER_MAX_SESSIONS
  value: {{ int $v.maxSessions | quote }}
- name: SPECREC_VERIFIER_MAX_WIDTH
  value: {{ int $v.maxWidth | quote }}
- name: SPECREC_VERIFIER_MAX_CANDIDATES
  value: {{ int $v.maxCandidates | quote }}
- name: SPECREC_VERIFIER_WARMUP_K
  value: {{ $v.warmupK | toJson | quote }}
- name: SPECREC_VERIFIER_HANG_S
  value: {{ $v.hangS | toString | quote }}
- name: SPECREC_VERIFIER_REQUIRE_GPU
  value: {{ and $v.gpu.enabled $v.gpu.required | toString | quote }}
{{- end -}}

{{- define "specrec.env.gateway" -}}
{{- $v := .Values.gateway -}}
- name: SPECREC_GATEWAY_ITEMSET_ADDR
  value: {{ include "specrec.addr" (list . "itemset") | quote }}
- name: SPECREC_GATEWAY_DRAFTER_ADDR
  value: {{ include "specrec.replicasAddr" (list . "drafter") | quote }}
- name: SPECREC_GATEWAY_VERIFIER_ADDR
  value: {{ include "specrec.replicasAddr" (list . "verifier") | quote }}
- name: SPECREC_GATEWAY_DEFAULT_POLICY
  value: {{ $v.defaultPolicy | quote }}
- name: SPECREC_GATEWAY_DEFAULT_BUDGET_MS
  value: {{ $v.defaultBudgetMs | toString | quote }}
- name: SPECREC_GATEWAY_MAX_BUDGET_MS
  value: {{ $v.maxBudgetMs | toString | quote }}
- name: SPECREC_GATEWAY_MAX_K
  value: {{ int $v.maxK | quote }}
- name: SPECREC_GATEWAY_MAX_HISTORY_ITEMS
  value: {{ int $v.maxHistoryItems | quote }}
- name: SPECREC_GATEWAY_MAX_HISTORY
  value: {{ int $v.maxHistory | quote }}
- name: SPECREC_GATEWAY_MAX_BATCH
  value: {{ int $v.maxBatch | quote }}
- name: SPECREC_GATEWAY_DRAFTER_MODE
  value: {{ $v.drafterMode | quote }}
- name: SPECREC_GATEWAY_WORKERS
  value: {{ int $v.workers | quote }}
- name: SPECREC_GATEWAY_PROCESSES
  value: {{ int $v.processes | quote }}
- name: SPECREC_GATEWAY_MAX_CONCURRENT_RPCS
  value: {{ int $v.maxConcurrentRpcs | quote }}
{{- if $v.healthPort }}
- name: SPECREC_GATEWAY_HEALTH_PORT
  value: {{ int $v.healthPort | quote }}
{{- end }}
{{- if $v.policyDefaults }}
- name: SPECREC_GATEWAY_POLICY_DEFAULTS
  value: {{ $v.policyDefaults | toJson | quote }}
{{- end }}
{{- end -}}

{{/* Pod annotations for Prometheus; args: (list $ "itemset") */}}
{{- define "specrec.podAnnotations" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- $ann := merge (deepCopy ($v.podAnnotations | default dict)) (deepCopy ($root.Values.common.podAnnotations | default dict)) -}}
{{- if $root.Values.metrics.enabled -}}
{{- $_ := set $ann "prometheus.io/scrape" "true" -}}
{{- $_ := set $ann "prometheus.io/port" (toString (int $v.metricsPort)) -}}
{{- $_ := set $ann "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- toYaml $ann -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: preStop sleep + the services' grace period + 5 s margin */}}
{{- define "specrec.terminationGracePeriodSeconds" -}}
{{- add (int .Values.common.preStopSleepS) (int (ceil .Values.common.graceS)) 5 -}}
{{- end -}}
