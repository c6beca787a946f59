"""TensorBoard scalars as a framework's metric log (OpenRLHF, NeMo-RL), read with tensorboard's own code.

OpenRLHF and NeMo-RL write their per-step metrics with ``torch.utils.tensorboard.SummaryWriter``
(``add_scalar(tag, value, step)``). The event files are read here with the ``tensorboard``
package's record reader and its ``Event`` protobuf (``tensorboard.compat``), and each value is
converted with ``tensorboard.data_compat.migrate_value`` and ``tensor_util.make_ndarray``, the
same path TensorBoard's own ``EventAccumulator`` takes. The accumulator itself is not used: it
stops silently at the first truncated or corrupt record (its loader swallows ``DataLossError``,
``event_file_loader.py``), so a damaged file would import as a shorter run. Here such a file is
refused, naming it, the record and the byte where the damage starts; nothing is written.

A run resumed from a checkpoint writes a second event file into the same folder and logs some
steps again; the files are read in the order they were created (the timestamp in their name) and
a later file's value for a step replaces an earlier one's, which the importer says in a note.
Non-finite values are returned as they are (NaN, +-inf): the importer keeps them as data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from reward_lens.record.errors import RecordError
from reward_lens_spec.files import UnreadableFile, require_regular

_EVENTS = re.compile(r"^events\.out\.tfevents\.(\d+)\.")
INSTALL = "pip install 'reward-lens[openrlhf]'"


@dataclass
class Scalars:
    """Every scalar of a run's event files: ``values[tag][step] = (value, where)``."""

    files: list[Path]
    values: dict[str, dict[int, tuple[float, str]]] = field(default_factory=dict)
    replaced: int = 0  # values a later event file logged again for the same step (a resumed run)


def event_files(folder: Path, what: str) -> list[Path]:
    """The event files of one run: those in ``folder``, else those of its one subfolder that has
    any (OpenRLHF writes ``<tensorboard_dir>/<run_name>/``), in the order they were created."""
    if not folder.is_dir():
        raise RecordError(folder, f"not a directory: {what}")
    files = [f for f in folder.iterdir() if _EVENTS.match(f.name)]
    if not files:
        subs = sorted(d for d in folder.iterdir() if d.is_dir() and any(_EVENTS.match(f.name) for f in d.iterdir()))
        if len(subs) > 1:
            raise RecordError(folder, f"holds the event files of {len(subs)} runs ({', '.join(d.name for d in subs[:5])}"
                              f"{', ...' if len(subs) > 5 else ''}): name one run's folder")
        if not subs:
            raise RecordError(folder, f"no TensorBoard event files (events.out.tfevents.*) here or in a subfolder: {what}")
        files = [f for f in subs[0].iterdir() if _EVENTS.match(f.name)]
    for f in files:
        try:
            require_regular(f)
        except FileNotFoundError:
            raise RecordError(f, "a broken symbolic link") from None
        except UnreadableFile as exc:
            raise RecordError(f, exc.problem) from None
    return sorted(files, key=lambda f: (int(_EVENTS.match(f.name).group(1)), f.name))


def read_scalars(folder: Path, what: str) -> Scalars:
    """Every scalar (``add_scalar``) of the run's event files; other summaries (text, histograms)
    are passed over. A damaged file is a RecordError naming it and the record."""
    try:
        from tensorboard import data_compat
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
        from tensorboard.util import tensor_util
    except ImportError:
        raise RecordError(folder, f"reading TensorBoard event files needs the `tensorboard` package ({INSTALL})") from None
    from google.protobuf.message import DecodeError

    out = Scalars(files=event_files(folder, what))
    for path in out.files:
        reader = pywrap_tensorflow.PyRecordReader_New(str(path))
        n = 0
        try:
            while True:
                try:
                    reader.GetNext()
                except errors.OutOfRangeError:
                    break
                except errors.DataLossError as exc:
                    problem = str(exc).replace(str(path), "").strip()
                    raise RecordError(f"{path}: record {n + 1}", f"damaged ({problem}): not a TensorBoard event file, or "
                                      "one cut short or corrupted after its first "
                                      f"{n} records; nothing was imported") from None
                n += 1
                where = f"{path.name}: record {n}"
                try:
                    event = event_pb2.Event.FromString(reader.record())
                except DecodeError as exc:
                    raise RecordError(f"{path}: record {n}", f"not a TensorBoard event ({exc})") from None
                if not event.HasField("summary"):
                    continue  # the file_version header, session logs
                for value in event.summary.value:
                    value = data_compat.migrate_value(value)
                    if value.metadata.plugin_data.plugin_name != "scalars":
                        continue
                    try:
                        arr = tensor_util.make_ndarray(value.tensor)
                    except (ValueError, TypeError) as exc:
                        raise RecordError(f"{path}: record {n}", f"the scalar is not a number ({exc})",
                                          field=value.tag) from None
                    if arr.size != 1 or arr.dtype.kind not in "fiu":
                        raise RecordError(f"{path}: record {n}", f"the scalar holds {arr.dtype} of shape {arr.shape}, "
                                          "not one number", field=value.tag)
                    steps = out.values.setdefault(value.tag, {})
                    if event.step in steps and steps[event.step][1].split(":")[0] != path.name:
                        out.replaced += 1
                    steps[int(event.step)] = (float(arr.reshape(())), where)
        finally:
            reader.file_handle.close()
    return out
