"""Every key of a params file is honoured, listed as ignored at the start with its reason, or an error: the
published Llama-3 configs (cluster memory keys in the trainer layout's GlobalFlags), the cluster-only runconfig
keys, unknown keys with their line and a "did you mean", and runconfig keys that set the run's defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from waferscale.cli.main import main
from waferscale.errors import ConfigError
from waferscale.params import load_params, params_from_dict
from waferscale.params.cluster_keys import CLUSTER_KEYS
from waferscale.zoo import runner
from waferscale.zoo.runner import prepare_run

from conftest import tiny_params
from test_config import tiny, write

ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"
LLAMA3 = {"params_llama3_8b.yaml": "8,030.3M", "params_llama3_70b.yaml": "70,553.7M",
          "params_llama3p1_70b_msl_8k.yaml": "70,553.7M"}


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_published_llama3_configs_validate_and_say_what_they_ignore(name: str, capsys) -> None:
    assert main(["validate", str(ZOO / name)]) == 0
    out, err = capsys.readouterr()
    assert f"valid ({LLAMA3[name]}-parameter model)" in out
    lines = err.splitlines()
    assert lines and all(ln.startswith("ignored: ") and ln.endswith(")") for ln in lines), err
    if name != "params_llama3_8b.yaml":  # the trainer layout's GlobalFlags carry the coordinator memory limits
        why = CLUSTER_KEYS["compile_crd_memory_gi"]
        assert f"ignored: runconfig.compile_crd_memory_gi ({why})" in lines
        assert f"ignored: runconfig.execute_crd_memory_gi ({why})" in lines
        assert any(ln.startswith("ignored: trainer.init.callbacks[3].ComputeNorm (") for ln in lines)


def test_estimate_params_says_what_it_ignores_first(capsys) -> None:
    """(test_compiler_families compiles the stored configs; `wsc compile --params` reads them the same way)"""
    assert main(["estimate", "--params", str(ZOO / "params_mpt_7B.yaml"), "--json"]) == 0  # (in its runconfig)
    out, err = capsys.readouterr()
    assert out.startswith("{") and "ignored: runconfig.execute_crd_memory_gi (" in err


def test_every_cluster_key_is_accepted_and_listed(tmp_path: Path) -> None:
    d = tiny()
    d["runconfig"].update({key: 1 for key in CLUSTER_KEYS})
    p = load_params(write(tmp_path, d))
    assert {f"runconfig.{k}": why for k, why in CLUSTER_KEYS.items()}.items() <= p.ignored.items()


def test_a_misspelt_cluster_key_is_an_error_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny(), sort_keys=False) + "  compile_crd_memory_g: 67\n")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: runconfig.compile_crd_memory_g: unknown key "
                                          r"'compile_crd_memory_g' \(did you mean 'compile_crd_memory_gi'\?\)"):
        load_params(path)
    line = int(str(pytest.raises(ConfigError, load_params, path).value).split(":")[1])
    assert path.read_text().splitlines()[line - 1].strip().startswith("compile_crd_memory_g:")


def test_trainer_callbacks_are_mapped_or_refused() -> None:
    def trainer(callbacks: list) -> dict:
        return {"trainer": {"init": {"model": {"name": "gpt-tiny"}, "optimizer": {"AdamW": {}},
                                     "schedulers": [{"ConstantLR": {"learning_rate": 1e-3}}],
                                     "loop": {"max_steps": 10}, "callbacks": callbacks},
                            "fit": {"train_dataloader": {"data_dir": "shakespeare", "batch_size": 8,
                                                         "max_sequence_length": 32}}}}

    p = params_from_dict(trainer([{"LoadCheckpointStates": {"load_checkpoint_states": "model"}},
                                  {"GlobalFlags": {"csx.debug.wrk_memory_gi": 40}}]))
    assert p.runconfig.load_checkpoint_states == "model" and "runconfig.wrk_memory_gi" in p.ignored
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.ComputeNrm: unknown key 'ComputeNrm' \(did you mean "
                                          r"'ComputeNorm'\?\)"):
        params_from_dict(trainer([{"ComputeNrm": {}}]))
    with pytest.raises(ConfigError, match=r"GlobalFlags\.csx\.debug\.ini_x: is not supported"):
        params_from_dict(trainer([{"GlobalFlags": {"csx.debug.ini_x": 1}}]))


def test_runconfig_sets_the_run_defaults_and_flags_win(tmp_path: Path) -> None:
    d = tiny()
    d["runconfig"].update(mode="train_and_eval", load_checkpoint_states="model", checkpoint_path="ck.json")
    path = write(tmp_path, d)
    _, opts = prepare_run(path, {})
    assert (opts.mode, opts.load_checkpoint_states, opts.checkpoint_path) == ("train_and_eval", "model", "ck.json")
    _, opts = prepare_run(path, {"mode": "eval", "load_checkpoint_states": None})
    assert (opts.mode, opts.load_checkpoint_states) == ("eval", "model")


def test_loss_weight_is_honoured_ignored_or_refused(tmp_path: Path) -> None:
    d = tiny()
    d["model"].update(loss_scaling="batch_size", loss_weight=1 / 32)  # the token mean over 32-token windows
    assert "model.loss_weight" not in load_params(write(tmp_path, d)).ignored
    d["model"]["loss_weight"] = 1.0
    with pytest.raises(ConfigError, match=r"model\.loss_weight: 1\.0 with loss_scaling batch_size scales the loss "
                                          r"to 32 x the mean"):
        load_params(write(tmp_path, d))
    d["model"].update(loss_scaling="num_tokens", loss_weight=0.5)
    assert "model.loss_weight" in load_params(write(tmp_path, d)).ignored


def test_loss_scale_keys_apply_to_float16_only(tmp_path: Path) -> None:
    d = tiny()
    d["model"].update(mixed_precision=True, fp16_type="bfloat16")
    d["optimizer"].update(loss_scaling_factor="dynamic", initial_loss_scale=1024)
    p = load_params(write(tmp_path, d))
    assert p.ignored["optimizer.initial_loss_scale"] == "bfloat16 training needs no loss scaling"
    assert "optimizer.loss_scaling_factor" in p.ignored
    d["model"]["fp16_type"] = "float16"
    with pytest.raises(ConfigError, match=r"optimizer\.initial_loss_scale: is not supported: float16 loss scaling"):
        load_params(write(tmp_path, d))
    del d["optimizer"]["initial_loss_scale"]
    assert not [k for k in load_params(write(tmp_path, d)).ignored if k.startswith("optimizer.")]


def test_eval_input_keys_it_does_not_read_are_listed(tmp_path: Path) -> None:
    d = tiny()
    d["eval_input"] = {"data_dir": "shakespeare", "batch_size": 8, "micro_batch_size": 4, "num_workers": 2,
                       "tokenizer": "smollm2"}
    ignored = load_params(write(tmp_path, d)).ignored
    assert {"eval_input.micro_batch_size", "eval_input.num_workers"} <= ignored.keys()
    assert ignored["eval_input.tokenizer"] == "evaluation reads with train_input's tokenizer 'char'"


def test_log_steps_and_eval_frequency_shape_metrics_jsonl(corpus: Path, tmp_path: Path) -> None:
    path = write(tmp_path, tiny_params(corpus, tmp_path / "md", log_steps=4, max_steps=6, eval_frequency=3,
                                       mode="train_and_eval"))
    assert main(["run", "--params", str(path), "--no_progress"]) == 0
    lines = [json.loads(ln) for ln in (tmp_path / "md" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [3, 4, 6]  # every 4th step, the last, and the evaluated step 3
    assert [ln.get("eval_batches") for ln in lines] == [2, None, None] and lines[0]["eval_loss"] > 0
    summary = json.loads((tmp_path / "md" / "summary.json").read_text())
    assert summary["mode"] == "train_and_eval" and summary["eval_batches"] == 2  # runconfig.mode; after training


def test_attention_module_and_norm_placement_are_honoured_or_refused(tmp_path: Path) -> None:
    d = tiny()
    d["model"].update(attention_module="multiquery_attention")  # Model Zoo's MQA: one key/value head by default
    assert load_params(write(tmp_path, d)).model.to_model_config().kv_heads == 1
    d["model"].update(attention_module="aiayn_attention", extra_attention_params={"num_kv_groups": 2})
    with pytest.raises(ConfigError, match=r"extra_attention_params: num_kv_groups applies to attention_module "
                                          r"multiquery_attention"):
        load_params(write(tmp_path, d))
    d["model"] = {"name": "gpt-tiny", "norm_first": True}
    load_params(write(tmp_path, d))
    d["model"]["norm_first"] = False
    with pytest.raises(ConfigError, match=r"model\.norm_first: false is not supported: decoder blocks are pre-norm"):
        load_params(write(tmp_path, d))


def test_the_hdf5_loader_keys_are_listed_on_text(corpus: Path, tmp_path: Path, capsys) -> None:
    d = tiny_params(corpus, tmp_path / "md")
    d["train_input"].update(num_workers=4, drop_last=False)
    d["eval_input"] = {"data_dir": str(corpus), "batch_size": 4, "max_sequence_length": 16}
    params = load_params(write(tmp_path, d))
    runner.prepare_data(params, params.model.to_model_config(), progress=False)
    err = capsys.readouterr().err
    assert "ignored: train_input.num_workers (" in err and "ignored: train_input.drop_last (" in err
    assert "ignored: eval_input.max_sequence_length (evaluation reads windows of train_input's length)" in err


@pytest.mark.parametrize("key, typo", [("rotary_dim", "rotary_dims"), ("weight_decay", "weight_decy"),
                                       ("shuffle_seed", "shufle_seed")])
def test_a_misspelt_trainer_layout_key_points_at_its_line(tmp_path: Path, key: str, typo: str) -> None:
    text = (ZOO / "params_llama3_70b.yaml").read_text()
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.strip().startswith(f"{key}:"))
    path = tmp_path / "p.yaml"
    path.write_text(text.replace(f" {key}:", f" {typo}:", 1))
    with pytest.raises(ConfigError, match=rf"^{path}:{line}: \w+\.{typo}: unknown key '{typo}' \(did you mean "
                                          rf"'{key}'\?\)"):
        load_params(path)
