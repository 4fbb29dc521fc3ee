{{/* ------------------------------------------------------------------ names and labels */}}
{{- define "stepwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stepwatch.fullname" -}}
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

{{- define "stepwatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* selector labels: (dict "ctx" $ "component" "agent") */}}
{{- define "stepwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepwatch.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{/* every object's labels: (dict "ctx" $ "component" "agent") */}}
{{- define "stepwatch.labels" -}}
helm.sh/chart: {{ include "stepwatch.chart" .ctx }}
{{ include "stepwatch.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: stepwatch
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "stepwatch.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "stepwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stepwatch.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "stepwatch.grafanaNamespace" -}}
{{- default .Release.Namespace .Values.grafana.namespace -}}
{{- end -}}

{{/* the Grafana snapshot: the folder the publisher writes and the datasource opens (same path in both pods) */}}
{{- define "stepwatch.snapshotDir" -}}
{{- printf "%s/snapshot" .Values.grafana.snapshot.mountPath -}}
{{- end -}}

{{- define "stepwatch.snapshotPvcName" -}}
{{- default (printf "%s-grafana-snapshot" (include "stepwatch.fullname" .)) .Values.grafana.snapshot.persistence.existingClaim -}}
{{- end -}}

{{- define "stepwatch.pvcName" -}}
{{- default (printf "%s-data" (include "stepwatch.fullname" .)) .Values.store.persistence.existingClaim -}}
{{- end -}}

{{/* "true" when the store volume can be mounted by pods on several nodes at once */}}
{{- define "stepwatch.storeShared" -}}
{{- if and .Values.store.persistence.enabled (has "ReadWriteMany" .Values.store.persistence.accessModes) -}}true{{- end -}}
{{- end -}}

{{/* the lake's data files are on S3 ("true") */}}
{{- define "stepwatch.lakeS3" -}}
{{- if hasPrefix "s3://" .Values.store.lake.dataPath -}}true{{- end -}}
{{- end -}}

{{/* the pods need the store volume: a SQLite catalog or data files on it ("true") */}}
{{- define "stepwatch.lakeVolume" -}}
{{- if or (eq .Values.store.lake.catalog "sqlite") (not (include "stepwatch.lakeS3" .)) -}}true{{- end -}}
{{- end -}}

{{/* processors may run side by side (rolling updates, replicas): nothing ReadWriteOnce between them */}}
{{- define "stepwatch.multiWriter" -}}
{{- if and (eq .Values.store.lake.catalog "postgres") (or (include "stepwatch.lakeS3" .) (include "stepwatch.storeShared" .)) -}}true{{- end -}}
{{- end -}}

{{/* environment of processor and compaction: where the lake is (storage/lake.py) */}}
{{- define "stepwatch.lakeEnv" -}}
{{- $l := .Values.store.lake -}}
{{- if eq $l.catalog "postgres" }}
- name: STEPWATCH_LAKE_CATALOG
  value: {{ printf "postgres:%s" $l.postgres.connection | quote }}
{{- if $l.postgres.passwordSecret.name }}
- name: STEPWATCH_LAKE_PASSWORD_FILE
  value: /etc/stepwatch/lake-catalog/password
{{- end }}
{{- end }}
{{- if $l.dataPath }}
- name: STEPWATCH_LAKE_DATA_PATH
  value: {{ $l.dataPath | quote }}
{{- end }}
{{- if include "stepwatch.lakeS3" . }}
- name: STEPWATCH_S3_ENDPOINT
  value: {{ $l.s3.endpoint | quote }}
- name: STEPWATCH_S3_REGION
  value: {{ $l.s3.region | quote }}
- name: STEPWATCH_S3_URL_STYLE
  value: {{ $l.s3.urlStyle | quote }}
- name: STEPWATCH_S3_USE_SSL
  value: {{ $l.s3.useSSL | quote }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $l.s3.credentialsSecret.name }}
      key: {{ $l.s3.credentialsSecret.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $l.s3.credentialsSecret.name }}
      key: {{ $l.s3.credentialsSecret.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* the catalog's password Secret as a file (STEPWATCH_LAKE_PASSWORD_FILE; never an env value) */}}
{{- define "stepwatch.lakeVolumeMounts" -}}
{{- if and (eq .Values.store.lake.catalog "postgres") .Values.store.lake.postgres.passwordSecret.name }}
- name: lake-catalog-password
  mountPath: /etc/stepwatch/lake-catalog
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stepwatch.lakeVolumes" -}}
{{- $s := .Values.store.lake.postgres.passwordSecret -}}
{{- if and (eq .Values.store.lake.catalog "postgres") $s.name }}
- name: lake-catalog-password
  secret:
    secretName: {{ $s.name }}
    defaultMode: 0440
    items:
      - key: {{ $s.key }}
        path: password
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------ security contexts */}}
{{- define "stepwatch.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "stepwatch.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* ------------------------------------------------------------------ Kafka client set-up */}}
{{- define "stepwatch.saslEnabled" -}}
{{- if hasPrefix "SASL" .Values.kafka.securityProtocol -}}true{{- end -}}
{{- end -}}

{{- define "stepwatch.kafkaEnv" -}}
- name: STEPWATCH_BOOTSTRAP
  value: {{ .Values.kafka.bootstrapServers | quote }}
- name: STEPWATCH_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: STEPWATCH_KAFKA_SECURITY_PROTOCOL
  value: {{ .Values.kafka.securityProtocol | quote }}
{{- if include "stepwatch.saslEnabled" . }}
- name: STEPWATCH_KAFKA_SASL_MECHANISM
  value: {{ .Values.kafka.sasl.mechanism | quote }}
- name: STEPWATCH_KAFKA_USERNAME
  value: {{ .Values.kafka.sasl.username | quote }}
- name: STEPWATCH_KAFKA_PASSWORD_FILE
  value: /etc/stepwatch/kafka-sasl/password
{{- end }}
{{- end -}}

{{/* command-line flags every Kafka client takes (TLS files, partitions of topics it creates) */}}
{{- define "stepwatch.kafkaArgs" -}}
- --partitions
- {{ .Values.kafka.topics.partitions | quote }}
{{- with .Values.kafka.tls.secret }}
- --ssl-cafile
- /etc/stepwatch/kafka-tls/ca.crt
{{- if $.Values.kafka.tls.certKey }}
- --ssl-certfile
- /etc/stepwatch/kafka-tls/tls.crt
{{- end }}
{{- if $.Values.kafka.tls.keyKey }}
- --ssl-keyfile
- /etc/stepwatch/kafka-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{- define "stepwatch.kafkaVolumeMounts" -}}
{{- if include "stepwatch.saslEnabled" . }}
- name: kafka-sasl
  mountPath: /etc/stepwatch/kafka-sasl
  readOnly: true
{{- end }}
{{- if .Values.kafka.tls.secret }}
- name: kafka-tls
  mountPath: /etc/stepwatch/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stepwatch.kafkaVolumes" -}}
{{- if include "stepwatch.saslEnabled" . }}
- name: kafka-sasl
  secret:
    secretName: {{ .Values.kafka.sasl.passwordSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .Values.kafka.sasl.passwordSecret.key }}
        path: password
{{- end }}
{{- with .Values.kafka.tls }}
{{- if .secret }}
- name: kafka-tls
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
    items:
      - key: {{ .caKey }}
        path: ca.crt
      {{- if .certKey }}
      - key: {{ .certKey }}
        path: tls.crt
      {{- end }}
      {{- if .keyKey }}
      - key: {{ .keyKey }}
        path: tls.key
      {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------ other secrets */}}
{{- /* The processor signs profiling commands: only it gets the private key. */}}
{{- define "stepwatch.profilingEnv" -}}
{{- if .Values.profiling.enabled }}
- name: STEPWATCH_PROFILING_PRIVATE_KEY_FILE
  value: /etc/stepwatch/profiling/signing-key.pem
{{- end }}
{{- end -}}

{{- /* Agents (and training pods, see NOTES) verify with the public key only. */}}
{{- define "stepwatch.profilingPublicEnv" -}}
{{- if .Values.profiling.enabled }}
- name: STEPWATCH_PROFILING_PUBLIC_KEY
  value: {{ .Values.profiling.publicKey | quote }}
{{- end }}
{{- end -}}

{{- define "stepwatch.profilingVolumeMounts" -}}
{{- if .Values.profiling.enabled }}
- name: profiling-key
  mountPath: /etc/stepwatch/profiling
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stepwatch.profilingVolumes" -}}
{{- if .Values.profiling.enabled }}
- name: profiling-key
  secret:
    secretName: {{ .Values.profiling.signingKeySecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .Values.profiling.signingKeySecret.key }}
        path: signing-key.pem
{{- end }}
{{- end -}}

{{- define "stepwatch.grafanaTokenVolume" -}}
- name: grafana-token
  secret:
    secretName: {{ .Values.grafana.tokenSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .Values.grafana.tokenSecret.key }}
        path: token
{{- end -}}

{{/* the processor's Alertmanager flags (stepwatch process --alertmanager ...) */}}
{{- define "stepwatch.alertmanagerArgs" -}}
{{- $am := .Values.alertmanager -}}
{{- range $am.urls }}
- --alertmanager
- {{ . | quote }}
{{- end }}
{{- if $am.urls }}
- --alertmanager-resend
- {{ $am.resendInterval | quote }}
{{- if $am.credentialsSecret.name }}
- --alertmanager-credentials-file
- /etc/stepwatch/alertmanager/credentials
- --alertmanager-auth
- {{ $am.authType }}
{{- end }}
{{- if .Values.grafana.url }}
- --grafana-link-url
- {{ .Values.grafana.url | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------ checks across values */}}
{{- define "stepwatch.validate" -}}
{{- $v := .Values -}}
{{- if include "stepwatch.saslEnabled" . -}}
{{- if not $v.kafka.sasl.mechanism -}}
{{- fail (printf "kafka.securityProtocol=%s needs kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)" $v.kafka.securityProtocol) -}}
{{- end -}}
{{- if not $v.kafka.sasl.username -}}
{{- fail (printf "kafka.securityProtocol=%s needs kafka.sasl.username" $v.kafka.securityProtocol) -}}
{{- end -}}
{{- if not $v.kafka.sasl.passwordSecret.name -}}
{{- fail (printf "kafka.securityProtocol=%s needs kafka.sasl.passwordSecret.name: an existing Secret holding the SASL password (it is mounted as a file, never put in values)" $v.kafka.securityProtocol) -}}
{{- end -}}
{{- end -}}
{{- if and $v.kafka.tls.secret (not (or (eq $v.kafka.securityProtocol "SSL") (eq $v.kafka.securityProtocol "SASL_SSL"))) -}}
{{- fail (printf "kafka.tls.secret is set but kafka.securityProtocol is %s: use SSL or SASL_SSL" $v.kafka.securityProtocol) -}}
{{- end -}}
{{- if and $v.kafka.tls.secret (ne (empty $v.kafka.tls.certKey) (empty $v.kafka.tls.keyKey)) -}}
{{- fail "kafka.tls.certKey and kafka.tls.keyKey go together (mutual TLS needs both the client certificate and its key)" -}}
{{- end -}}
{{- if hasKey $v.profiling "hmacKeySecret" -}}
{{- fail "profiling.hmacKeySecret was removed: commands are signed with Ed25519 now (the processors hold the private key, nodes and training pods only the public one). Run 'stepwatch profile keygen DIR', create a Secret from DIR/profiling-signing-key.pem and set profiling.signingKeySecret.name and profiling.publicKey (docs/profiling.md)" -}}
{{- end -}}
{{- if and $v.profiling.enabled (not $v.profiling.signingKeySecret.name) -}}
{{- fail "profiling.enabled needs profiling.signingKeySecret.name: an existing Secret with the Ed25519 private key (PEM) that signs profiling commands ('stepwatch profile keygen DIR' makes one)" -}}
{{- end -}}
{{- if and $v.profiling.enabled (not $v.profiling.publicKey) -}}
{{- fail "profiling.enabled needs profiling.publicKey: the base64 Ed25519 public key agents and training pods verify commands with ('stepwatch profile keygen DIR' prints it)" -}}
{{- end -}}
{{- if hasKey $v.profiling "pySpy" -}}
{{- fail "profiling.pySpy was removed: the agent never runs py-spy nor needs ptrace (it stays non-root without capabilities); the probe in the training process starts py-spy against itself, so the TRAINING container needs the permission (docs/profiling.md, \"py-spy permissions\"). Choose the profiler per alert kind with STEPWATCH_PROFILE_ON in processor.extraEnv" -}}
{{- end -}}
{{- if $v.profiling.enabled -}}
{{- $t := $v.profiling.traceDir.hostPath -}}
{{- /* the agent mounts the trace directory at its node path: it must not shadow or nest in the agent's own mounts */ -}}
{{- range $m := list "/run/stepwatch" "/var/lib/stepwatch/spool" "/host" "/tmp" "/etc" "/usr" "/proc" "/sys" "/dev" "/bin" "/lib" $v.agent.socketDir.hostPath $v.agent.spool.hostPath -}}
{{- if or (eq $t $m) (hasPrefix (printf "%s/" $m) $t) (hasPrefix (printf "%s/" $t) $m) -}}
{{- fail (printf "profiling.traceDir.hostPath=%s collides with %s (the agent mounts the trace directory at the same path as on the node): use a directory of its own, e.g. /var/lib/stepwatch/traces" $t $m) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.processor.enabled (gt (int $v.processor.replicas) 1) -}}
{{- if ne $v.store.lake.catalog "postgres" -}}
{{- fail (printf "processor.replicas=%d needs store.lake.catalog=postgres (with store.lake.postgres.connection): a SQLite catalog serves one processor" (int $v.processor.replicas)) -}}
{{- end -}}
{{- if not (include "stepwatch.lakeS3" .) -}}
{{- if not $v.store.persistence.enabled -}}
{{- fail (printf "processor.replicas=%d with the data files on the store volume needs store.persistence.enabled (or store.lake.dataPath=s3://...)" (int $v.processor.replicas)) -}}
{{- end -}}
{{- if not (include "stepwatch.storeShared" .) -}}
{{- fail (printf "processor.replicas=%d needs data files every replica reaches: store.lake.dataPath=s3://bucket/prefix, or store.persistence.accessModes [ReadWriteMany] (any shared filesystem; describing store.persistence.existingClaim if you use one)" (int $v.processor.replicas)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.compaction.enabled (eq $v.compaction.mode "sidecar") -}}
{{- fail (printf "compaction.mode=sidecar runs one compactor per processor: with processor.replicas=%d use compaction.mode=cronjob" (int $v.processor.replicas)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.compaction.enabled (eq $v.compaction.mode "cronjob") (not $v.store.persistence.enabled) (include "stepwatch.lakeVolume" .) -}}
{{- fail "compaction.mode=cronjob needs store.persistence.enabled (a CronJob cannot reach the processor's emptyDir): enable persistence or use compaction.mode=sidecar" -}}
{{- end -}}
{{- if and $v.compaction.enabled (eq $v.compaction.mode "sidecar") (not $v.processor.enabled) -}}
{{- fail "compaction.mode=sidecar runs inside the processor pod: enable the processor or use compaction.mode=cronjob" -}}
{{- end -}}
{{- if and $v.processor.enabled $v.processor.grafanaAnnotations (or (not $v.grafana.url) (not $v.grafana.tokenSecret.name)) -}}
{{- fail "processor.grafanaAnnotations needs grafana.url and grafana.tokenSecret.name (an existing Secret with a Grafana service-account token)" -}}
{{- end -}}
{{- if and $v.grafana.provisionJob.enabled (or (not $v.grafana.url) (not $v.grafana.tokenSecret.name)) -}}
{{- fail "grafana.provisionJob.enabled needs grafana.url and grafana.tokenSecret.name (an existing Secret with a Grafana service-account token; Editor for dashboards and rules, Admin for the datasource)" -}}
{{- end -}}
{{- range $k := list "dataRoot" "lake" -}}
{{- if hasKey $v.grafana $k -}}
{{- fail (printf "grafana.%s was removed: Grafana no longer attaches the lake (with the catalog's extension loaded, a panel's SQL could read any file Grafana can read and rewrite the catalog). The chart's publisher copies the views into a read-only snapshot that Grafana mounts at grafana.snapshot.mountPath (docs/helm.md, section 4): drop grafana.%s and mount that volume in Grafana" $k $k) -}}
{{- end -}}
{{- end -}}
{{- if and (or $v.grafana.datasource.enabled $v.grafana.provisionJob.enabled) (not $v.grafana.snapshot.enabled) -}}
{{- fail "grafana.datasource.enabled and grafana.provisionJob.enabled need grafana.snapshot.enabled: the DuckDB datasource reads the snapshot the publisher writes (it never attaches the lake)" -}}
{{- end -}}
{{- if and $v.grafana.snapshot.enabled (not $v.store.persistence.enabled) (include "stepwatch.lakeVolume" .) -}}
{{- fail "grafana.snapshot.enabled needs store.persistence.enabled (the publisher cannot reach the processor's emptyDir): enable persistence, or grafana.snapshot.enabled=false with grafana.datasource.enabled=false" -}}
{{- end -}}
{{- if and $v.alertmanager.credentialsSecret.name (not $v.alertmanager.urls) -}}
{{- fail "alertmanager.credentialsSecret.name is set but alertmanager.urls is empty: list the Alertmanager URL(s) the processor posts alerts to" -}}
{{- end -}}
{{- if and $v.agent.enabled (not (include "stepwatch.agentGroups" .)) -}}
{{- fail "agent.enabled but no agent.nodeGroups entry is enabled: enable one (nvidia, ascend) or add your own" -}}
{{- end -}}
{{- end -}}

{{/* names of the enabled agent node groups, comma-separated ("" when none) */}}
{{- define "stepwatch.agentGroups" -}}
{{- $names := list -}}
{{- range $name, $g := .Values.agent.nodeGroups -}}
{{- if $g.enabled -}}{{- $names = append $names $name -}}{{- end -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- define "stepwatch.compactArgs" -}}
- compact
- --data-dir
- {{ .Values.store.mountPath }}
- --target-mb
- {{ .Values.compaction.targetMB | quote }}
{{- if gt (float64 .Values.compaction.retentionDays) 0.0 }}
- --retention-days
- {{ .Values.compaction.retentionDays | quote }}
{{- end }}
{{- end -}}
