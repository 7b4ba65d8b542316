{{/* A mesh is one mode's: its values file says which (values-<mode>.yaml). */}}
{{- define "prism.mode" -}}
{{- if not .Values.stages -}}
{{- fail "no stages: install with one mode's values, -f values-<mode>.yaml (prism deploy helm writes one for any flags)" -}}
{{- end -}}
{{- end -}}

{{/* The labels of the mesh's objects; with a component, of one stage's. */}}
{{- define "prism.labels" -}}
app.kubernetes.io/name: prism
app.kubernetes.io/instance: {{ .name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{/* Object metadata: name, namespace, labels. */}}
{{- define "prism.meta" -}}
name: {{ .objectName }}
namespace: {{ .root.Values.namespace }}
labels:
  {{- include "prism.labels" (dict "name" .root.Values.name "component" .component) | nindent 2 }}
{{- end -}}

{{/* Every pod runs as the image's unprivileged user (prism.ops.deploy.security). */}}
{{- define "prism.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "prism.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
  - ALL
{{- end -}}

{{/* What a container writes under its read-only root. */}}
{{- define "prism.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/prism
{{- end -}}

{{- define "prism.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end -}}
