"""Getting a checkpoint onto a pod: `deepseek-pd download` (an init container in Kubernetes).

- `layout.py`: where a Hub snapshot lands in the cache volume (the operator renders the same path).
- `failures.py`: why a download failed, as a reason, an exit code and a termination message that
  the operator turns into the `ModelReady` condition (False, reason = the failure).
- `hub_download.py`: a Hugging Face Hub snapshot with huggingface_hub, resumable byte by byte.
- `local_source.py`: a pvc/hostPath checkpoint: no download, the directory is checked.
- `progress.py`: the progress log.
Only `hub_download` imports huggingface_hub, so the operator can import the rest cheaply.
"""
