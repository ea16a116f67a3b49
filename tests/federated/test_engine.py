"""Engine properties: determinism, state swapping, communication accounting, checkpoints, config, bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfpfl.config import RunArguments
from hfpfl.arguments import load_config_file, parse_run_args
from hfpfl.federated.comm import tensor_bytes
from conftest import CPU_ONLY, CPU_PROCESSES, LAUNCH_TWO

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num_clients", "4", "--max_per_domain", "100", "--image_size", "16", "--batch_size", "16",
         "--progress", "false"]


def test_same_seed_same_results_and_different_seed_differs(run_sim):
    _, a = run_sim("fedavg", output_dir="a")
    _, b = run_sim("fedavg", output_dir="b")
    _, c = run_sim("fedavg", output_dir="c", seed=1)
    assert a["final"] == b["final"] and a["per_client_accuracy"] == b["per_client_accuracy"]
    assert a["final"] != c["final"]


def test_one_model_instance_and_private_state_only(run_sim):
    sim, _ = run_sim("fedbn", num_rounds=1)
    private_bytes = tensor_bytes({k: sim.model_state[k] for k in sim.algorithm.private_keys})
    assert all(set(sim.store.get(c)) == {"model"} for c in range(sim.num_clients))
    model_bytes = tensor_bytes(sim.model_state)
    assert sim.store.nbytes() == sim.num_clients * private_bytes
    assert private_bytes < model_bytes / 10  # the store holds norms, not model copies


def test_communication_is_counted_exactly(run_sim):
    sim, res = run_sim("fedavg", num_rounds=2, clients_per_round=2)
    model_bytes = tensor_bytes({k: sim.model_state[k] for k in sim.algorithm.global_keys})
    comm = res["communication"]
    assert comm["bytes_up"] == comm["bytes_down"] == 2 * 2 * model_bytes
    sampled = [c for h in sim.history for c in h["clients"]]
    assert len(sampled) == 4 and all(len(h["clients"]) == 2 for h in sim.history)
    for cid, v in comm["per_client"].items():
        assert v["bytes_up"] == sampled.count(int(cid)) * model_bytes


def test_client_sampling_is_seeded_and_fractional(run_sim):
    sim, _ = run_sim("fedavg", run=False, client_fraction=0.5)
    s1 = [sim.sample_clients(r) for r in range(1, 6)]
    assert all(len(s) == 2 for s in s1)
    assert s1 == [sim.sample_clients(r) for r in range(1, 6)]
    assert len({tuple(s) for s in s1}) > 1


def test_results_contract_files(run_sim):
    sim, res = run_sim("fedavg", num_rounds=2)
    out = Path(sim.args.output_dir)
    for name in ("config.yaml", "results.json", "metrics.jsonl", "accuracy_curve.png", "client_accuracy.png"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    assert saved["final"] == res["final"] and saved["communication"]["bytes_up"] > 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert set(res["final"]) >= {"global_accuracy", "personal_accuracy", "new_client_accuracy"}
    assert res["wall_time_s"] > 0 and set(res["per_domain_accuracy"]) == {"mnist", "usps", "mnistm", "syn"}


def test_lora_adapter_only_adapters_and_head_travel(run_sim):
    sim, res = run_sim("fedavg", num_rounds=1, adapter="lora", lora_r=2)
    up = sim.last_updates[0].upload["model"]
    assert up and all("lora_" in k or "classifier" in k or "running" in k or "num_batches" in k for k in up)
    assert any("lora_" in k for k in up)
    full = tensor_bytes(sim.model_state)
    assert tensor_bytes(up) < full / 3


def test_refuses_to_overwrite_finished_run(run_sim):
    run_sim("fedavg", num_rounds=1, output_dir="same")
    with pytest.raises(FileExistsError, match="--resume_from_checkpoint latest"):
        run_sim("fedavg", num_rounds=1, output_dir="same", overwrite_output_dir=False)


def test_unknown_method_and_bad_arguments():
    with pytest.raises(ValueError, match="unknown method 'fedavgg'.*fedavg"):
        parse_run_args(["--method", "fedavgg"])
    with pytest.raises(ValueError, match="client_fraction"):
        RunArguments(client_fraction=0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        RunArguments(lr=-1)


def test_yaml_config_and_flag_precedence(tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("method: fedprox\nmu: 0.5\nnum_rounds: 7\nnum_clients: 3\n")
    run, data, method_cfg = parse_run_args(["--config", str(cfg), "--num_rounds", "9"])
    assert (run.method, run.num_rounds, data.num_clients, method_cfg.mu) == ("fedprox", 9, 3, 0.5)
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_round: 3\n")
    with pytest.raises(ValueError, match="unknown config key 'num_round'.*num_rounds"):
        load_config_file(bad, [RunArguments])


def test_unknown_flag_is_rejected():
    with pytest.raises(ValueError, match="unknown option '--num_roundz'.*--num_rounds"):
        parse_run_args(["--num_roundz", "3"])
    with pytest.raises(ValueError, match="unknown option '--mu'"):
        parse_run_args(["--method", "fedavg", "--mu", "0.1"])  # a FedProx option is not a FedAvg option


def test_corrupt_and_mismatched_checkpoints(run_sim, tmp_path):
    sim, _ = run_sim("fedavg", num_rounds=2, output_dir="ck")
    out = Path(sim.args.output_dir)
    latest = sorted((out / "checkpoints").glob("round-*"))[-1]
    # mismatched: a different method cannot resume this checkpoint
    with pytest.raises(ValueError, match="other settings.*method"):
        run_sim("fedbn", num_rounds=3, output_dir="ck", resume_from_checkpoint="latest", overwrite_output_dir=False)
    # a recipe's own data options (FedPCE's --levels, FedDAT's --vqa_split) are part of what a checkpoint computed
    run_sim("fedavg", num_rounds=1, output_dir="rk", recipe_settings={"levels": "paper"})
    with pytest.raises(ValueError, match="other settings.*levels.*'paper'.*'cycled'"):
        run_sim("fedavg", num_rounds=2, output_dir="rk", resume_from_checkpoint="latest", overwrite_output_dir=False,
                recipe_settings={"levels": "cycled"})
    # corrupt: truncated safetensors
    data = (latest / "server.safetensors").read_bytes()
    (latest / "server.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        run_sim("fedavg", num_rounds=3, output_dir="ck", resume_from_checkpoint="latest", overwrite_output_dir=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        run_sim("fedavg", output_dir="empty", resume_from_checkpoint="latest", overwrite_output_dir=False)


def test_metrics_file_is_appended_and_a_resume_drops_lines_after_its_checkpoint(run_sim, tmp_path):
    import shutil
    sim, _ = run_sim("fedavg", num_rounds=3, output_dir="hist", checkpoint_every=2)
    out = Path(sim.args.output_dir)
    metrics = out / "metrics.jsonl"
    ref = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [h["round"] for h in ref] == [1, 2, 3]  # rounds 2 and 3 were appended to round 1's file
    # a crash after round 3's metrics but before its checkpoint, mid-way through a later line
    shutil.rmtree(out / "checkpoints" / "round-00003")
    with open(metrics, "a") as f:
        f.write('{"round": 4, "global_acc')
    run_sim("fedavg", num_rounds=3, output_dir="hist", checkpoint_every=2, resume_from_checkpoint="latest",
            overwrite_output_dir=False)
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [h["round"] for h in got] == [1, 2, 3]
    assert got[2]["global_accuracy"] == ref[2]["global_accuracy"]


def _recipe(args, out, env_extra=None, launcher=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + [str(ROOT / "recipes" / "run.py"), *SMALL, "--output_dir", str(out), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final(out):
    res = json.loads((Path(out) / "results.json").read_text())
    return res["final"], res["per_client_accuracy"], res["communication"]["bytes_up"]


@pytest.mark.slow
def test_resume_after_kill_gives_same_results(tmp_path, kill_after_first_checkpoint):
    args = ["--method", "fedprox", "--num_rounds", "5", "--checkpoint_every", "1"]
    ref = _recipe(args, tmp_path / "ref")
    kill_after_first_checkpoint(_recipe(args, tmp_path / "killed"), tmp_path / "killed")
    resumed = _recipe(args + ["--resume_from_checkpoint", "latest"], tmp_path / "killed")
    assert resumed.wait() == 0, resumed.stdout.read()
    assert ref.wait() == 0, ref.stdout.read()
    assert _final(tmp_path / "ref") == _final(tmp_path / "killed")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedbn", "feddf"])  # streaming (all-reduced sums) and gather (server work once)
def test_two_processes_give_the_same_final_metrics(tmp_path, method):
    # Dir(0.1) client sizes (train 25 / 103 / 66 / 10): the balanced owners are {1} and {0, 2, 3}, not i % 2; an
    # evaluation batch of 16 splits the global test set over both processes
    args = ["--method", method, "--num_rounds", "2", "--num_new_clients", "1", "--partition", "dirichlet",
            "--alpha", "0.1", "--eval_batch_size", "16"]
    one = _recipe(args, tmp_path / "one", env_extra=CPU_ONLY)
    assert one.wait() == 0, one.stdout.read()
    two = _recipe(args, tmp_path / "two", env_extra=CPU_PROCESSES, launcher=LAUNCH_TWO)
    out = two.stdout.read()
    assert two.wait() == 0, out
    res = json.loads((tmp_path / "two" / "results.json").read_text())
    assert res["world_size"] == 2, out
    assert _final(tmp_path / "one") == _final(tmp_path / "two")
    assert res["process_train_examples"] == [103, 101]   # balanced (i % 2 would give 91 / 113)
