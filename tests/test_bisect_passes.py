"""tools/bisect_passes.py (`minimax-compile bisect`): one compile per pass flipped, each against eager."""

from __future__ import annotations

import json

import pytest

from minimax_backend.tools.cli import main as cli_main


def test_bisect_flips_the_named_pass_and_the_code_generator(tmp_path, capsys):
    out = tmp_path / "bisect.json"
    cli_main(["bisect", "--preset", "tiny-m3", "--dtype", "float32", "--tokens", "13", "--options",
              '{"codegen": "fx", "cudagraphs": false, "fuse_norm_rope": "off"}', "--passes", "fuse_norm_rope", "--json", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["default", "fuse_norm_rope=on", "codegen=inductor"]
    # float32, FX codegen: the rewrites are exact against eager, the fusion included
    assert rows["default"]["max_rel_err"] == 0.0 and rows["fuse_norm_rope=on"]["max_rel_err"] == 0.0
    assert rows["fuse_norm_rope=on"]["matches"] > 0 and rows["default"]["matches"] == ""
    assert rows["codegen=inductor"]["max_rel_err"] < 1e-4 and rows["codegen=inductor"]["argmax_agreement"] == 1.0
    # every row watched the MoE's routing: in float32 no token takes another expert
    assert all(r["flipped_tokens"] == 0 and r["flips"]["tokens"] == [] for r in rows.values())
    assert rows["default"]["max_rel_err_unflipped"] == rows["default"]["max_rel_err"]
    assert "compiled vs eager per pass flipped" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--options", "[1]"], "--options: not a JSON object"),
    (["--options", '{"no_such_option": 1}'], "--options:"),
    (["--tokens", "0"], "--tokens must be at least 1"),
])
def test_bad_input_is_refused_with_the_reason(args, message):
    from minimax_backend.tools.bisect_passes import main

    with pytest.raises(SystemExit, match=message.replace("[", "\\[")):
        main(args)
