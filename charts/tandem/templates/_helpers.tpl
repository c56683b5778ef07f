{{- define "tandem.operatorName" -}}tandem-operator{{- end -}}

{{- define "tandem.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ include "tandem.operatorName" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
