{{/* Chart name, truncated to the 63-character label limit. */}}
{{- define "deepseek-pd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name of the operator's objects. */}}
{{- define "deepseek-pd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "deepseek-pd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deepseek-pd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "deepseek-pd.labels" -}}
{{ include "deepseek-pd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "deepseek-pd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "deepseek-pd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "deepseek-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces the operator watches, as a JSON list: operator.watchNamespaces, else the release
namespace; [] with operator.watchAllNamespaces (every namespace, cluster-wide RBAC). */}}
{{- define "deepseek-pd.watchedNamespaces" -}}
{{- if .Values.operator.watchAllNamespaces -}}
{{- if .Values.operator.watchNamespaces -}}
{{- fail "operator.watchAllNamespaces watches every namespace: leave operator.watchNamespaces empty" -}}
{{- end -}}
[]
{{- else if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* What the operator does to DeepSeekDeployments and their children (operator/kube.py RESOURCES).
With router.workerDiscovery Selector the router gets a Role (pods get/list/watch); granting it
requires holding those verbs, which these rules do (no escalate/bind). Secrets: created once and
deleted by name, never listed or patched (operator/secret_reconcile.py); get also reads the
user's router.apiKeySecret to report it missing. */}}
{{- define "deepseek-pd.managerRules" -}}
- apiGroups: ["deepseek-pd.io"]
  resources: ["deepseekdeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["deepseek-pd.io"]
  resources: ["deepseekdeployments/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["deepseek-pd.io"]
  resources: ["deepseekrolescales"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]  # watched: an HPA's /scale write runs a pass
- apiGroups: ["deepseek-pd.io"]
  resources: ["deepseekrolescales/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Only used with spec.metrics.serviceMonitor (the Prometheus Operator's CRD).
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Only used with spec.scheduling.gang (Kubernetes' in-tree PodGroup, scheduling.k8s.io/v1beta1).
- apiGroups: ["scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* The pod securityContext of the operator and helm-test pods: a uid >= 10000 (podSecurity). */}}
{{- define "deepseek-pd.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsUser }}
fsGroup: {{ .Values.podSecurity.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The API credentials of a pod that talks to the API server, mounted explicitly into the one
container that needs them (automountServiceAccountToken is off, so no other container and no
init container gets a token): what the kubelet would automount, with a bounded lifetime. */}}
{{- define "deepseek-pd.apiTokenVolume" -}}
- name: api-token
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: {{ .Values.operator.tokenExpirationSeconds }}
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end -}}

{{- define "deepseek-pd.apiTokenMount" -}}
- name: api-token
  mountPath: /var/run/secrets/kubernetes.io/serviceaccount
  readOnly: true
{{- end -}}
