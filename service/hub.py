"""Models by name (docs/deployment.md, "Models by name"): ``--model`` given as a Hub id (``org/name``) is fetched
with huggingface_hub's own ``snapshot_download`` into its cache (tokens, revisions, resume and offline mode are
huggingface_hub's), only the files serving needs, then checked to be a DiffusionGemma checkpoint we can load.

Public contract:
    is_hub_id(model)            True for ``org/name`` that is not an existing directory
    fetch(repo_id, revision, cache_dir, log_progress) -> str   the snapshot directory; HubError (one line) when
                                the repository cannot be had: gated without a token, not found, no network and
                                nothing cached, not enough disk, not a DiffusionGemma checkpoint
    probe(repo_id, revision, cache_dir) -> str   for --dry-run: a directory with its config.json (the cached
                                snapshot, or config.json alone); the same HubError, weights never downloaded

huggingface_hub reads its own environment (HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE); this
module reads none. Progress: huggingface_hub's bars (on a terminal only), or with ``log_progress`` one log line
per file started and finished, with bytes and rate (the JSON-lines log format).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any

log = logging.getLogger("dgserve.hub")

# what serving reads from a checkpoint (docs/deployment.md, "Models by name"); nothing else is downloaded
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "hf_quant_config.json",  # ModelOpt's quantization section (NVFP4)
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "processor_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
]
MODEL_TYPES = ("diffusion_gemma", "diffusion_gemma_text")
QUANT_METHODS = {"modelopt": "ModelOpt NVFP4", "compressed-tensors": "compressed-tensors"}
LICENCE_URL = "https://huggingface.co/{}"
FIX = "--model / env NIM_MODEL_NAME"


class HubError(Exception):
    """A model named by id cannot be had; the message is one line naming the problem and what fixes it."""


def is_hub_id(model: str) -> bool:
    """``org/name``: exactly one '/', no leading '.', '/' or '~', and no existing directory by that name (a local
    directory always wins)."""
    return (
        model.count("/") == 1
        and not model.startswith((".", "/", "~"))
        and all(model.split("/"))
        and not os.path.isdir(model)
    )


def fetch(repo_id: str, revision: str | None = None, cache_dir: str | None = None, log_progress: bool = False) -> str:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: the default branch) in the huggingface_hub
    cache ``cache_dir`` (default: HF_HUB_CACHE), downloading what is missing; checked as a DiffusionGemma checkpoint.
    HubError with one line when it cannot be had."""
    from huggingface_hub import constants

    cache = cache_dir or constants.HF_HUB_CACHE
    where = f"model {repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        path = _download(repo_id, revision, cache, log_progress)
    except HubError:
        raise
    except Exception as e:
        raise HubError(f"{where}: {_describe(e, repo_id, revision, cache)}") from e
    check_checkpoint(path, repo_id)
    return path


def probe(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """For ``--dry-run``: a directory holding ``repo_id``'s config.json, without downloading its weights: the cached
    snapshot when there is one, else config.json fetched alone. HubError (one line, as ``fetch``) when the model
    cannot be had: not reachable, not cached with HF_HUB_OFFLINE, gated, not found, not a DiffusionGemma."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir or constants.HF_HUB_CACHE
    where = f"model {repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        try:
            path = snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS, local_files_only=True
            )
        except LocalEntryNotFoundError:
            if constants.HF_HUB_OFFLINE:
                raise
            path = os.path.dirname(hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache))
        if not os.path.isfile(os.path.join(path, "config.json")):
            path = os.path.dirname(hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache))
    except Exception as e:
        raise HubError(f"{where}: {_describe(e, repo_id, revision, cache)}") from e
    check_checkpoint(path, repo_id)
    return path


def _download(repo_id: str, revision: str | None, cache: str, log_progress: bool) -> str:
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import disable_progress_bars

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per HTTP request is not progress
    hf_log = logging.getLogger("huggingface_hub")  # its warnings (a resumed transfer) go through our log format only
    for handler in [h for h in hf_log.handlers if type(h) is logging.StreamHandler]:
        hf_log.removeHandler(handler)
    if log_progress:
        disable_progress_bars()  # the log lines below report progress instead
    files: list[Any] = []
    if not constants.HF_HUB_OFFLINE:
        try:
            info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled):
            info = None  # no network: snapshot_download serves from the cache, or says it cannot
        if info is not None:
            files = _wanted(info)
            _check_disk(repo_id, info.sha, files, cache)
            if log_progress:
                for f in files:
                    _fetch_one(hf_hub_download, repo_id, info.sha, f, cache)
    return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS)


def _wanted(info) -> list[Any]:
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(info.siblings or [], allow_patterns=ALLOW_PATTERNS, key=lambda s: s.rfilename))


def _check_disk(repo_id: str, sha: str | None, files: list[Any], cache: str) -> None:
    """HubError when the files not yet in the cache need more bytes than the cache's disk has free."""
    from huggingface_hub.file_download import repo_folder_name

    snapshot = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"), "snapshots", str(sha))
    need = sum(f.size or 0 for f in files if not os.path.exists(os.path.join(snapshot, f.rfilename)))
    probe = os.path.abspath(cache)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if need > free:
        raise HubError(
            f"model {repo_id}: not enough free disk: its files need {_size(need)}, {cache} has {_size(free)} free "
            "(free some space, or choose another place with --download-dir / env NIM_CACHE_PATH)"
        )


def _fetch_one(hf_hub_download, repo_id: str, sha: str | None, sibling, cache: str) -> None:
    """One file, with a log line when it starts and one when it is done (bytes and rate)."""
    name, size = sibling.rfilename, sibling.size or 0
    counter = _ByteCounter.factory(name)
    t0 = time.monotonic()
    hf_hub_download(repo_id, name, revision=sha, cache_dir=cache, tqdm_class=counter)
    seconds = max(time.monotonic() - t0, 1e-6)
    got = counter.received
    if not counter.started:
        log.info("download: %s already in the cache", name, extra={"file": name, "bytes": size})
        return
    log.info(
        "download finished: %s, %s in %.1f s (%s/s)",
        name,
        _size(size),
        seconds,
        _size(got / seconds),
        extra={"file": name, "bytes": size, "seconds": round(seconds, 3), "bytes_per_second": round(got / seconds)},
    )


class _ByteCounter:
    """The progress class hf_hub_download is given: logs the start of one file's transfer and counts its bytes."""

    name = ""
    received = 0
    started = False

    @classmethod
    def factory(cls, name: str) -> type[_ByteCounter]:
        return type("ByteCounter", (cls,), {"name": name, "received": 0, "started": False})

    def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs) -> None:
        cls = type(self)
        if not cls.started:
            cls.started = True
            resumed = f", resuming at {_size(initial)}" if initial else ""
            log.info(
                "download started: %s, %s%s",
                cls.name,
                _size(total or 0),
                resumed,
                extra={"file": cls.name, "bytes": total, "resume_from": initial},
            )

    def update(self, n: int | float | None = 1) -> None:
        type(self).received += int(n or 0)

    def close(self) -> None:
        pass

    def __enter__(self) -> _ByteCounter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def check_checkpoint(path: str, repo_id: str) -> None:
    """HubError unless ``path``'s config.json is a DiffusionGemma one with a quantization we load."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise HubError(f"model {repo_id}: no readable config.json in the repository ({e}) ({FIX})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in MODEL_TYPES:
        raise HubError(
            f"model {repo_id}: not a DiffusionGemma checkpoint: config.json model_type is {kind!r}, dgserve serves "
            f"{' / '.join(MODEL_TYPES)} ({FIX})"
        )
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if qc is not None and method not in QUANT_METHODS:
        known = ", ".join(f"{v} ({k!r})" for k, v in QUANT_METHODS.items())
        raise HubError(
            f"model {repo_id}: quantization_config.quant_method {method!r} is not supported: dgserve loads {known} "
            f"or unquantized checkpoints ({FIX})"
        )


def _describe(e: Exception, repo_id: str, revision: str | None, cache: str) -> str:
    """One line for a huggingface_hub failure."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = LICENCE_URL.format(repo_id)
    if isinstance(e, GatedRepoError):
        if get_token() is None:
            return f"gated repository: set HF_TOKEN to a token of an account that accepted its licence at {url}"
        return f"gated repository: the token (HF_TOKEN) has no access; accept the licence at {url}"
    if isinstance(e, RevisionNotFoundError):
        return f"revision {revision or 'main'!r} does not exist (--revision / env DGSERVE_REVISION)"
    if isinstance(e, RepositoryNotFoundError):
        return f"no such repository on the Hub ({constants.ENDPOINT}), or it is private: check the id or set HF_TOKEN"
    if isinstance(e, HFValidationError):
        return f"not a valid Hub id: {' '.join(str(e).split())} ({FIX})"
    if isinstance(e, (LocalEntryNotFoundError, OSError)) and constants.HF_HUB_OFFLINE:
        return (
            f"HF_HUB_OFFLINE is set and it is not (completely) in the cache {cache} (download it with dgserve download)"
        )
    if isinstance(e, LocalEntryNotFoundError):
        return (
            f"the Hub ({constants.ENDPOINT}) cannot be reached and it is not (completely) in the cache {cache} "
            "(check the network, or download it ahead with dgserve download)"
        )
    detail = " ".join(f"{type(e).__name__}: {e}".split())
    return f"download failed: {detail[:300]}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
