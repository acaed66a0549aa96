"""The images the process kubelet can pull: names only, nothing is fetched.

Containers run the checkout's own environment whatever image they name (process_kubelet.py), so
an image is only looked up here, once per container, before its first start:

    ImageRegistry(None)             every name pulls (the kubelet's own tests use placeholders)
    ImageRegistry({"repo:1.0"})     "repo:1.0" pulls; "repo:1.1" fails as a missing tag does on a
                                    kubelet: waiting ErrImagePull, then ImagePullBackOff with a
                                    growing back-off, retried until the tag is pushed
    .push("repo:1.1")               what `make image IMAGE_TAG=1.1 && make image-push` would do

`made_images()`: the tags `make image` builds, what the e2e tests' registry holds.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

from pdtest.dockerfile import make_builds

# Placeholder image names of the kubelet's and the control plane's own tests.
PLACEHOLDER_IMAGES = frozenset({"none", "example.invalid/app:1"})


def made_images(*make_variables: str) -> frozenset[str]:
    """The tags `make image` builds, with `make_variables` (e.g. "IMAGE_TAG=0.2.0")."""
    return frozenset(tag for tags in make_builds("image", *make_variables).values() for tag in tags)


class ImageRegistry:
    def __init__(self, images: Iterable[str] | None) -> None:
        self._images = None if images is None else set(images)
        self._lock = threading.Lock()

    def push(self, *images: str) -> None:
        with self._lock:
            if self._images is None:
                raise ValueError("this registry pulls every name: pushing to it tests nothing")
            self._images.update(images)

    def pull_error(self, image: str) -> str:
        """"" when `image` pulls; else the kubelet's message for a tag the registry lacks."""
        with self._lock:
            if self._images is None or image in self._images:
                return ""
        return (f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull and '
                f'unpack image "{image}": failed to resolve reference "{image}": {image}: not found')
