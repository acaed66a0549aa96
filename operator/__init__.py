"""The deepseek-pd Kubernetes operator (kopf): DeepSeekDeployment -> worker groups + router.

Pure parts (tested without a cluster):
    names        deterministic child names, labels, API coordinates
    crd_spec     the spec's OpenAPI schema with defaults and CEL rules (the one source)
    crd          the CustomResourceDefinition and status schema built from it
    validation   schema + CEL evaluation (jsonschema, cel-python), as the API server does
    spec         the validated spec as frozen dataclasses; role revisions
    build_*      manifests for worker groups (StatefulSet, headless Service, ConfigMap) and router
    observed     cluster objects reduced to group states
    planner      desired vs observed groups -> Create/Replace/Restart/Delete actions
    status       phase and conditions
I/O:
    kube         a small async REST client; executor applies actions; reconcile runs one pass
    handlers     thin kopf handlers + a resync timer
"""
