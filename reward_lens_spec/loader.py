"""Load and validate the specs, reporting errors as ``file:line: what is wrong``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from reward_lens_spec.errors import SpecError
from reward_lens_spec.models import (
    BookSpec,
    FieldsCatalog,
    FindingSpec,
    FrameworkSpec,
    ImportersCatalog,
    RefusalCatalog,
)
from reward_lens_spec.paths import specs_dir
from reward_lens_spec.yamlload import line_for, load_yaml_with_lines

M = TypeVar("M", bound=BaseModel)


def load_model(path: Path, model: type[M]) -> M:
    """Parse ``path`` into ``model``; any problem raises SpecError naming file and line."""
    if not path.is_file():
        raise SpecError(f"{path}:1: spec file not found")
    data, lines = load_yaml_with_lines(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise SpecError(f"{path}:{line_for(loc, lines)}: {where}: {err['msg']}{more}") from None


@lru_cache(maxsize=None)
def _fields_cached(root: str) -> FieldsCatalog:
    path = Path(root) / "fields.yaml"
    catalog = load_model(path, FieldsCatalog)
    # Names are keys in YAML; carry them into the models so a FieldSpec knows itself.
    named = {n: f.model_copy(update={"name": n}) for n, f in catalog.fields.items()}
    for name, spec in named.items():
        if spec.unit not in catalog.units:
            raise SpecError(f"{path}:1: field `{name}` has unit `{spec.unit}`, which `units:` does not define")
    return catalog.model_copy(update={"fields": named})


def load_fields(root: Path | None = None) -> FieldsCatalog:
    return _fields_cached(str(root or specs_dir()))


@lru_cache(maxsize=None)
def _codes_cached(root: str) -> RefusalCatalog:
    return load_model(Path(root) / "refusal_codes.yaml", RefusalCatalog)


def load_refusal_codes(root: Path | None = None) -> RefusalCatalog:
    return _codes_cached(str(root or specs_dir()))


def _check_book(book: BookSpec, path: Path, root: Path) -> BookSpec:
    fields = load_fields(root)
    codes = load_refusal_codes(root)
    for req in book.requires:
        for alt in req.alternatives:
            for f in alt.fields:
                if f not in fields.fields:
                    raise SpecError(f"{path}:1: requirement `{req.id}` names unknown field `{f}` (not in fields.yaml)")
        for nm in req.near_misses:
            if nm.field not in fields.fields:
                raise SpecError(f"{path}:1: near miss names unknown field `{nm.field}` (not in fields.yaml)")
    for code in book.refusals:
        if code not in codes.codes:
            raise SpecError(f"{path}:1: refusal code `{code}` is not in refusal_codes.yaml")
    return book


@lru_cache(maxsize=None)
def _book_cached(root: str, book_id: str) -> BookSpec:
    path = Path(root) / "books" / f"{book_id}.yaml"
    book = load_model(path, BookSpec)
    if book.id != book_id:
        raise SpecError(f"{path}:1: id `{book.id}` does not match the file name `{book_id}.yaml`")
    return _check_book(book, path, Path(root))


def load_book(book_id: str, root: Path | None = None) -> BookSpec:
    return _book_cached(str(root or specs_dir()), book_id)


def load_books(root: Path | None = None) -> dict[str, BookSpec]:
    base = root or specs_dir()
    return {p.stem: load_book(p.stem, base) for p in sorted((base / "books").glob("*.yaml"))}


@lru_cache(maxsize=None)
def _framework_cached(root: str, name: str, folder: str = "frameworks") -> FrameworkSpec:
    path = Path(root) / folder / f"{name}.yaml"
    spec = load_model(path, FrameworkSpec)
    fields = load_fields(Path(root))
    for sup in spec.supplies:
        for f in sup.fields:
            if f not in fields.fields:
                raise SpecError(f"{path}:1: supplies unknown field `{f}` (not in fields.yaml)")
    return spec


def load_frameworks(root: Path | None = None) -> dict[str, FrameworkSpec]:
    base = root or specs_dir()
    return {p.stem: _framework_cached(str(base), p.stem) for p in sorted((base / "frameworks").glob("*.yaml"))}


def load_taps(root: Path | None = None) -> dict[str, FrameworkSpec]:
    """What a reward-lens tap records, keyed by the framework it taps (specs/taps/)."""
    base = root or specs_dir()
    specs = [_framework_cached(str(base), p.stem, "taps") for p in sorted((base / "taps").glob("*.yaml"))]
    return {s.taps or s.framework: s for s in specs}


@lru_cache(maxsize=None)
def _findings_cached(root: str) -> dict[str, FindingSpec]:
    folder = Path(root) / "findings"
    out: dict[str, FindingSpec] = {}
    known = set(_fields_cached(root).fields)
    for path in sorted(folder.glob("*.yaml")):
        spec = load_model(path, FindingSpec)
        if spec.id != path.stem:
            raise SpecError(f"{path}:1: id `{spec.id}` is not the file's name `{path.stem}`")
        unknown = [f for alt in spec.inputs for f in alt if f not in known]
        if unknown:
            raise SpecError(f"{path}:1: inputs name unknown record field(s) {unknown} (specs/fields.yaml)")
        books = set(p.stem for p in (Path(root) / "books").glob("*.yaml"))
        if set(spec.books) - books:
            raise SpecError(f"{path}:1: books names unknown book(s) {sorted(set(spec.books) - books)}")
        out[spec.id] = spec
    return out


def load_findings(root: Path | None = None) -> dict[str, FindingSpec]:
    """Every finding spec in ``specs/findings/``, by id, in file-name order."""
    return _findings_cached(str(root or specs_dir()))


@lru_cache(maxsize=None)
def _importers_cached(root: str) -> ImportersCatalog:
    return load_model(Path(root) / "importers.yaml", ImportersCatalog)


def load_importers(root: Path | None = None) -> ImportersCatalog:
    """What each ``reward-lens import <framework>`` reads and where the run leaves it."""
    return _importers_cached(str(root or specs_dir()))
