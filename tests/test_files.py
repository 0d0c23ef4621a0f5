"""Files written whole: a failed write leaves the old file and no partial one, a new file gets the
mode the umask gives (the umask untouched), a torn last line of a log is cut when it is reopened;
and a safetensors index may name only files beside it."""

import json
import os
import stat

import pytest

from tunix_train.config import ConfigError
from tunix_train.files import LineLog, write_atomically, write_text
from tunix_train.interop.hf import _SafetensorsFiles


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
    target = tmp_path / "config.json"
    write_text(target, "old\n")

    def fail(partial):
        partial.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fail)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["config.json"]
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["config.json"]


def test_a_new_file_gets_the_umasks_mode_and_the_umask_is_untouched(tmp_path):
    before = os.umask(0o027)
    try:
        write_text(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640
        assert os.umask(0o027) == 0o027  # what write_text left
    finally:
        os.umask(before)


def test_a_torn_last_line_is_cut_when_the_log_is_reopened(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = LineLog(path)
    log.append(json.dumps({"step": 1}))
    log.close()
    with open(path, "a") as torn:
        torn.write('{"step": 2, "lo')  # a crash in the middle of a line
    log = LineLog(path)
    log.append(json.dumps({"step": 2}))
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors", ".."])
def test_a_safetensors_index_names_only_files_beside_it(tmp_path, name):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ConfigError, match="its weight_map names .* not a file beside it"):
        _SafetensorsFiles(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.safetensors.index.json is not valid JSON"):
        _SafetensorsFiles(tmp_path)
