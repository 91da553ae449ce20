"""Starting, resuming or replacing a run: the checks made before anything is written.

The CLI makes them once before it launches N processes (a mistake is one line, exit 2),
and the trainer makes them again for library callers; both call these functions, so the
rules and their messages live here once.
"""

from __future__ import annotations

import os
from pathlib import Path

from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.training.checkpoint import CheckpointError, load_checkpoint
from receipt_embed.training.rundir import DATA_FILE, LAST, check_run_out, refuse_dataset_inside

# config keys that may change when resuming (everything else must match the checkpoint)
RESUMABLE_CHANGES = {"train.epochs", "train.max_minutes", "train.num_workers", "plugins.dir", "plugins.strict"}


def dataset_record(data_dir) -> dict:
    """Where a run's data lives and what it was, so --resume can find it and refuse another."""
    from receipt_embed.data.dataset_dir import MANIFEST_FILE
    from receipt_embed.fileio import sha256_file

    manifest = Path(data_dir) / MANIFEST_FILE
    return {
        "data_dir": str(Path(data_dir).resolve()),
        "manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
    }


def _read_data_record(run_dir) -> dict | None:
    from receipt_embed.fileio import read_json
    from receipt_embed.userfiles import UnusableFile

    path = Path(run_dir) / DATA_FILE
    if not os.path.lexists(path):
        return None
    try:
        saved = read_json(path)
        saved["data_dir"]
    except UnusableFile:
        raise  # a FIFO or device named as such: never read
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} is damaged; resume with --data DATASET_DIR (it is rewritten by a fresh run)"
        ) from None
    return saved


def recorded_data_dir(run_dir) -> str | None:
    """The dataset dir a run was started on (None for a run without data.json)."""
    saved = _read_data_record(run_dir)
    return saved["data_dir"] if saved else None


def trained_dataset(state: dict | None, path) -> dict | None:
    """The dataset a checkpoint says its run was trained on (None for a fresh run, or a checkpoint
    written before checkpoints recorded it: then data.json alone is compared)."""
    if state is None or ("data_dir" not in state and "manifest_sha256" not in state):
        return None
    data_dir, sha = state.get("data_dir"), state.get("manifest_sha256")
    if not isinstance(data_dir, str) or not data_dir:
        raise CheckpointError(f"{path}: data_dir is {shortened(repr(data_dir))}; --resume needs a dataset dir path")
    if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
        raise CheckpointError(f"{path}: manifest_sha256 is {shortened(repr(sha))}; --resume needs a sha256 or None")
    return {"data_dir": data_dir, "manifest_sha256": sha} if sha is not None else None


def _sha(value) -> str:
    """A manifest sha256 as a message shows it: its first 12 hex digits tell two apart."""
    if isinstance(value, str):
        return f"{value[:12]}..." if len(value) > 12 else value
    return shortened(repr(value))


def _check_record_matches_checkpoint(saved: dict, trained: dict, run_dir, path) -> None:
    """A data.json edited, or copied from another run, would take the run onto another dataset."""
    sha = saved.get("manifest_sha256")
    if sha is None or sha == trained["manifest_sha256"]:  # None: a data.json older than manifest checksums
        return
    raise CheckpointError(
        f"cannot resume {run_dir}: {Path(run_dir) / DATA_FILE} names {saved['data_dir']} (manifest sha256 "
        f"{_sha(sha)}), but {path} was trained on {trained['data_dir']} (manifest sha256 "
        f"{_sha(trained['manifest_sha256'])}); put back the run's own data.json, or start a new run with --force"
    )


def check_same_dataset(run_dir, record: dict, state: dict | None = None, path=None) -> None:
    """Refuse to resume a run on another dataset, or on its own dataset changed since: ``record``
    is compared with data.json and, when checkpoint ``state`` (read from ``path``) records its
    dataset, with the checkpoint's (a data.json swapped for another run's is refused too)."""
    saved = _read_data_record(run_dir)
    trained = trained_dataset(state, path)
    if saved is not None and trained is not None:
        _check_record_matches_checkpoint(saved, trained, run_dir, path)
    if saved is None and trained is None:
        return
    if record["manifest_sha256"] is None:
        raise CheckpointError(
            f"cannot resume {run_dir}: {record['data_dir']} holds no manifest.jsonl (moved or "
            "deleted?); pass --data with the dataset dir the run was trained on"
        )
    # the reference: data.json with its checksum, else the checkpoint's record (data.json gone or older)
    reference, source = (saved, Path(run_dir) / DATA_FILE)
    if trained is not None and (saved is None or not saved.get("manifest_sha256")):
        reference, source = trained, path
    if reference.get("manifest_sha256") and record["manifest_sha256"] != reference["manifest_sha256"]:
        if Path(record["data_dir"]) == Path(reference["data_dir"]):  # the same dir, re-ingested or edited since
            raise CheckpointError(
                f"cannot resume {run_dir}: the manifest of {record['data_dir']} changed since the "
                f"run was trained on it (its sha256 is not the one in {source}); "
                "resume on the dataset as it was, or start a new run with --force"
            )
        raise CheckpointError(
            f"cannot resume {run_dir} on {record['data_dir']}: the run was trained on "
            f"{reference['data_dir']}, whose manifest differs; resume with --data {reference['data_dir']}"
        )


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value and key != "params":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume_config(saved: dict, current: dict, path: Path) -> None:
    """Only RESUMABLE_CHANGES may differ between the checkpoint's config and the current one."""
    a, b = _flatten(saved), _flatten(current)
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES]
    if diffs:
        details = "; ".join(
            f"{k}: checkpoint {shortened(repr(a.get(k)))}, now {shortened(repr(b.get(k)))}" for k in diffs
        )
        raise CheckpointError(f"cannot resume from {path}: the config differs ({details})")


def open_run(run_dir, resume: bool, force: bool, world_size: int, config_dict: dict | None = None) -> dict | None:
    """The checkpoint to resume from (None for a fresh run), after refusing a resume over another
    process count or config, and a fresh run over an existing one without ``force``."""
    last = Path(run_dir) / LAST
    if not resume:
        if force:  # its files are moved aside and deleted: never the shell's current directory
            from receipt_embed.outdir import refuse_current_dir_in
            from receipt_embed.training.replacement import run_entries

            parts = [Path(run_dir) / name for name in run_entries(Path(run_dir))]
            refuse_current_dir_in(run_dir, parts, "--force replaces")
        if last.exists() and not force:
            raise CheckpointError(
                f"{run_dir} already holds a run ({last}); pass --resume to continue it, --force to "
                "replace it, or choose another --out"
            )
        return None
    if last.is_symlink():  # a run dir holds the files train wrote; a link there points somewhere else
        raise CheckpointError(
            f"cannot resume from {last}: it is a symbolic link (to {os.readlink(last)}), not a checkpoint "
            "this run wrote; copy the file in its place if it is the one to continue from"
        )
    if not os.path.lexists(last) and Path(run_dir).is_dir() and (Path(run_dir) / "config.yaml").exists():
        raise CheckpointError(  # a run stopped before its first checkpoint: nothing to continue
            f"checkpoint not found: {last}; the run was stopped before it saved one, so there is nothing to "
            f"resume: start it again with `receipt-embed train --data DATASET_DIR --out {run_dir} --force`"
        )
    state = load_checkpoint(last)
    if config_dict is not None:
        check_resume_config(state["config"], config_dict, last)
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise CheckpointError(
            f"{last} was written by a run over {saved_world} process(es); resume it with the same number "
            f"(--nproc {saved_world}), not {world_size}: the global batches would differ"
        )
    return state


def check_batch_splits(batch_size: int, identities: int, world_size: int) -> None:
    """Every process gets the same share of a global batch. The batch used is ``batch_size``
    lowered to the training identity count, and the message says so when it was."""
    used = min(batch_size, identities)
    if not used % world_size:
        return
    if world_size > identities:
        raise BadInput(
            f"{world_size} processes are more than the {identities} training identities, the largest global "
            f"batch (train.batch_size counts identities); use at most {identities} processes"
        )
    if used < batch_size:
        raise BadInput(
            f"train.batch_size {batch_size} is lowered to the {identities} training identities, and {used} does not "
            f"split over {world_size} processes; set train.batch_size to a multiple of {world_size} "
            f"no larger than {identities}"
        )
    raise BadInput(
        f"train.batch_size {batch_size} does not split over {world_size} processes; use a multiple of {world_size}"
    )


def preflight(config, data_dir, out: Path, resume: bool, nproc: int, force: bool = False) -> None:
    """Checks made once, before launching N processes (so a mistake is one line, exit 2)."""
    from receipt_embed.data.dataset_dir import load_dataset_dir, select_split

    check_run_out(out)
    refuse_dataset_inside(out, data_dir)
    identities = len(select_split(load_dataset_dir(data_dir), "train").identities)
    check_batch_splits(config.train.batch_size, identities, nproc)
    open_run(out, resume, force, nproc)
