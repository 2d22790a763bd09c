"""Which encoder version and precision variant serve, for the cache key.

The variant is what ``tritonserver --model-config-name=<name>`` selected: the encoder's
``configs/<name>.pbtxt`` when it exists, else its ``config.pbtxt`` (FP32). A Python model is
not told that name, so the launcher (server/process.py) and docker-compose pass it in the
environment as ``TRITON_MODEL_CONFIG_NAME``. The generated configs say their variant in their
header ("for variant 'int8'") and name the file (``default_model_filename``); a SHA-256 of
that file joins the key, so a re-export under the same version and name changes keys too.

The version is the encoder version Triton reports ready (``pb_utils.is_model_ready`` for
each version folder), checked on every batch: after a new version is loaded through the
repository API the next batch uses new keys. While several versions are ready (a canary, or
the moment of a swap) and the caller did not say which one serves, there is no identity and
the cache is bypassed. ``IdentityResolver.identity(version)`` is the one place the key's
version comes from; a caller that chooses the version itself (canary routing) passes it.

A version's identity is not computed once per process: a model re-exported under the same
version and reloaded must change the keys, or the old vectors would be served for the new
model. Every ``identity`` call compares the served config's and model file's ``stat``
(inode, size, mtime, ctime: three ``stat`` calls, 15-20 µs a batch here) with what the fingerprint was
computed from, and rehashes when they differ; a version seen not ready and then ready again
(unload, load) is rehashed whatever its ``stat`` says. Limit: between a file's replacement
and the encoder's reload, the still-loaded old model's vectors are stored under the new
file's keys; replace a served file only together with its reload (or export a new version).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from python_backends.cache.keys import ModelIdentity
from python_backends.files import sha256_file

log = logging.getLogger(__name__)

CONFIG_NAME_ENV = "TRITON_MODEL_CONFIG_NAME"
_VARIANT = re.compile(r"for variant '([^']+)'")
_FILENAME = re.compile(r'^\s*default_model_filename\s*:\s*"([^"]+)"', re.M)
_PLATFORM_DEFAULT = {"tensorrt_plan": "model.plan"}
_PLATFORM = re.compile(r'^\s*platform\s*:\s*"([^"]+)"', re.M)


def served_config(encoder_dir: Path, config_name: str | None) -> tuple[str, str]:
    """(variant, model file name) of the config Triton loads for this config name."""
    custom = encoder_dir / "configs" / f"{config_name}.pbtxt" if config_name else None
    path = custom if custom is not None and custom.is_file() else encoder_dir / "config.pbtxt"
    text = path.read_text(encoding="utf-8")
    m = _FILENAME.search(text)
    platform = _PLATFORM.search(text)
    filename = m.group(1) if m else _PLATFORM_DEFAULT.get(platform.group(1) if platform else "", "model.onnx")
    v = _VARIANT.search(text)
    variant = v.group(1) if v else ("fp32" if path.name == "config.pbtxt" else path.stem)
    return variant, filename


_FINGERPRINTS: dict[tuple, str] = {}


def file_signature(path: Path) -> tuple | None:
    """What changes when a file is replaced or rewritten (None if it is missing): inode, size,
    mtime and ctime (``cp -p`` over the file keeps the inode, size and mtime, not the ctime)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_fingerprint(path: Path, fresh: bool = False) -> str:
    """First 16 hex digits of the file's SHA-256 ("" if it is missing), cached by its
    ``file_signature``; ``fresh`` hashes it again whatever the cache holds."""
    signature = file_signature(path)
    if signature is None:
        return ""
    memo = (str(path), *signature)
    if fresh or memo not in _FINGERPRINTS:
        _FINGERPRINTS[memo] = sha256_file(path)[:16]
    return _FINGERPRINTS[memo]


class IdentityResolver:
    """The served identity of ``encoder`` as seen from a model in the same repository."""

    def __init__(self, repository: Path, model: str, encoder: str, config_name: str | None, is_ready: Callable[[str, str], bool]):
        self.repository = Path(repository)
        self.model = model
        self.encoder = encoder
        self.config_name = config_name if config_name is not None else os.environ.get(CONFIG_NAME_ENV) or None
        self._is_ready = is_ready
        # version -> (model file, _signature() when its identity was computed, identity)
        self._by_version: dict[str, tuple[Path, tuple, ModelIdentity]] = {}
        self._rehash: set[str] = set()  # versions to hash afresh (seen not ready, then ready)
        self._last: ModelIdentity | None = None
        self._ambiguous: list[str] = []
        self._ready: set[str] = set()  # versions ready at the last look

    def versions(self) -> list[str]:
        """Numeric version folders of the encoder, highest first."""
        encoder_dir = self.repository / self.encoder
        try:
            names = [p.name for p in encoder_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        except OSError:
            return []
        return sorted(names, key=int, reverse=True)

    def ready_versions(self) -> list[str]:
        """Versions Triton reports ready, highest first. A version that was not ready at the last
        look and is now (it was unloaded and loaded again) is fingerprinted afresh."""
        ready = [v for v in self.versions() if self._is_ready(self.encoder, v)]
        for version in set(ready) - self._ready:
            if version in self._by_version:
                self._by_version.pop(version)
                self._rehash.add(version)
        self._ready = set(ready)
        return ready

    def _signature(self, model: Path) -> tuple:
        """file_signature()s of what decides the identity: the variant's config (present or not),
        the base config, and the model file they name (three ``stat`` calls)."""
        encoder_dir = self.repository / self.encoder
        custom = file_signature(encoder_dir / "configs" / f"{self.config_name}.pbtxt") if self.config_name else None
        return custom, file_signature(encoder_dir / "config.pbtxt"), file_signature(model)

    def identity(self, version: str | None = None) -> ModelIdentity | None:
        """The identity for ``version``; without one, for the only ready version.

        None (the caller then bypasses the cache) when no version is ready, or when several
        are and none was named: then a request may be served by any of them (a canary, or the
        moment of a swap), and a vector could be stored under another version's key.
        """
        if version is None:
            ready = self.ready_versions()
            if len(ready) != 1:
                if ready and self._ambiguous != ready:
                    log.warning(
                        "%s versions %s are all ready and no version was chosen: the cache is bypassed until one version serves",
                        self.encoder,
                        ", ".join(ready),
                    )
                self._ambiguous = ready
                return None
            version = ready[0]
        found = self._current(version)
        if found != self._last:
            log.info("cache keys now for %s", found.describe())
            self._last = found
        return found

    def _current(self, version: str) -> ModelIdentity:
        """The identity of ``version``, recomputed when its served files' signatures changed."""
        known = self._by_version.get(version)
        if known is not None and self._signature(known[0]) == known[1]:
            return known[2]
        encoder_dir = self.repository / self.encoder
        variant, filename = served_config(encoder_dir, self.config_name)
        model = encoder_dir / version / filename
        fresh = version in self._rehash
        self._rehash.discard(version)
        identity = ModelIdentity(self.model, self.encoder, version, variant, file_fingerprint(model, fresh))
        self._by_version[version] = (model, self._signature(model), identity)
        if known is not None and known[2] != identity:
            log.info(
                "%s version %s changed on disk (file %s -> %s): new cache keys",
                self.encoder,
                version,
                known[2].fingerprint or "-",
                identity.fingerprint or "-",
            )
        return identity
