"""`lightning-dpzero ledger show|verify|plot` and the LightningCLI path, in-process (no training launched)."""

import json
import re
import sys

import pytest
import torch

from lightning_dpzero import PrivacyLedger
from lightning_dpzero.cli import epsilon_curve, main


def _ledger():
    led = PrivacyLedger(delta=1e-5, dataset_size=1000)
    led.charge(0.01, 1.1, steps=40)
    led.charge(0.02, 1.3, steps=25)
    led.charge(0.02, 1.3, steps=5)  # merges into the previous entry
    led.charge(0.05, 2.0, sampler="shuffle", steps=10)
    return led


@pytest.fixture
def ledger_file(tmp_path):
    led = _ledger()
    path = tmp_path / "privacy_ledger.json"
    led.save(path)
    return led, path


def _checkpoint_dir(tmp_path, json_ledger, state_ledger, name="mp_rank_00_model_states.pt", extra=None):
    """A directory laid out as DPDeepSpeedStrategy saves one (JSON beside a DeepSpeed client state)."""
    ckpt = tmp_path / "epoch=0-step=80.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    json_ledger.save(ckpt / "privacy_ledger.json")
    state = {"module": {"w": torch.zeros(2)}, "global_step": state_ledger.steps, "privacy_ledger": state_ledger.to_dict(),
             "callbacks": {"PrivacyAccountantCallback": {"ledger": state_ledger.to_dict(), "delta": 1e-5}}}
    if extra is not None:
        state["extra"] = extra
    torch.save(state, ckpt / "checkpoint" / name)
    _commit(ckpt, json_ledger, global_step=state_ledger.steps)
    return ckpt


def _commit(ckpt, ledger, global_step):
    """The commit marker, as DPDeepSpeedStrategy writes it last."""
    from lightning_dpzero.checkpoints.commit import checkpoint_files, file_digest, write_commit

    write_commit(ckpt, {"format": "lightning_dpzero.privacy_commit", "format_version": 1, "global_step": global_step,
                        "run_id": ledger.run_id, "ledger_head": ledger.head, "ledger_steps": ledger.steps,
                        "world_size": 1, "zero_stage": 2,
                        "files": {n: file_digest(ckpt / n) for n in checkpoint_files(ckpt)}})


class _Opaque:  # a pickled object that torch.load(weights_only=True) refuses
    pass


def test_show_prints_metadata_entries_and_exact_epsilon(ledger_file, capsys):
    led, path = ledger_file
    assert main(["ledger", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert led.run_id in out and "1000" in out and "1e-05" in out and "shuffle" in out
    assert re.search(r"total steps:\s+80\b", out)
    assert len(re.findall(r"^\s+\d+\s+0\.0\d+\s+\d\.\d+\s+\d+\s+(poisson|shuffle)$", out, re.M)) == 3
    assert float(re.search(r"epsilon \(pld\):\s+(\S+)", out).group(1)) == led.epsilon()
    assert float(re.search(r"epsilon \(rdp\):\s+(\S+)", out).group(1)) == led.epsilon(accountant="rdp")
    assert "torch" in out and led.head in out


def test_show_json_and_directory_path(tmp_path, capsys):
    led = _ledger()
    ckpt = _checkpoint_dir(tmp_path, led, led)
    assert main(["ledger", "show", "--json", str(ckpt)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["run_id"] == led.run_id and s["steps"] == 80 and s["epsilon"] == led.epsilon()
    assert [e["steps"] for e in s["entries"]] == [40, 30, 10]


def test_verify_ok_then_hand_edit_exits_1(ledger_file, capsys):
    led, path = ledger_file
    assert main(["ledger", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and repr(led.epsilon()) in out
    d = json.loads(path.read_text())
    d["entries"][0]["steps"] = 4  # spend less privacy on paper
    path.write_text(json.dumps(d))
    assert main(["ledger", "verify", str(path)]) == 1
    captured = capsys.readouterr()
    assert "TAMPERED" in captured.err and not captured.out.startswith("OK")


def test_verify_missing_ledger_exits_1(tmp_path, capsys):
    assert main(["ledger", "verify", str(tmp_path / "nope.json")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "ckpt").mkdir()
    assert main(["ledger", "verify", str(tmp_path / "ckpt")]) == 1
    assert "holds no privacy_ledger.json" in capsys.readouterr().err


def test_a_run_directory_leads_to_the_ledger_below_it(tmp_path, capsys):
    """`ledger show lightning_logs/digits`: the run's log directory, with its checkpoint one level down."""
    led = _ledger()
    run_dir = tmp_path / "lightning_logs" / "digits"
    ckpt = _checkpoint_dir(run_dir / "checkpoints", led, led)
    assert main(["ledger", "show", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert led.run_id in captured.out and str(ckpt) in captured.err
    assert main(["ledger", "verify", str(run_dir)]) == 0  # the checkpoint's client state is compared too
    assert capsys.readouterr().out.splitlines()[1].startswith("client state: matches")
    other = _ledger()
    _checkpoint_dir(run_dir / "older", other, other)
    assert main(["ledger", "show", str(run_dir)]) == 1  # two below it: which one is the user's to say
    err = capsys.readouterr().err
    assert "pass one of them" in err and str(ckpt) in err and "older" in err
    (tmp_path / "empty").mkdir()
    assert main(["ledger", "show", str(tmp_path / "empty")]) == 1
    assert "enable_checkpointing" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"])
def test_verify_checkpoint_compares_client_state(tmp_path, capsys, name):
    led = _ledger()
    ckpt = _checkpoint_dir(tmp_path, led, led, name=name)
    assert main(["ledger", "verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "client state: matches" in out and "callbacks.PrivacyAccountantCallback" in out


def test_verify_checkpoint_mismatch_exits_1(tmp_path, capsys):
    led = _ledger()
    other = PrivacyLedger.from_dict(led.to_dict())
    other.charge(0.05, 2.0, sampler="shuffle", steps=5)  # a validly hashed, different ledger
    ckpt = _checkpoint_dir(tmp_path, led, other)
    assert main(["ledger", "verify", str(ckpt)]) == 1
    assert "MISMATCH" in capsys.readouterr().err


def test_verify_untrusted_pickle_is_not_loaded_unless_asked(tmp_path, capsys):
    led = _ledger()
    ckpt = _checkpoint_dir(tmp_path, led, led, extra=_Opaque())
    assert main(["ledger", "verify", str(ckpt)]) == 0
    assert "not compared" in capsys.readouterr().out
    assert main(["ledger", "verify", "--trust-checkpoint", str(ckpt)]) == 0
    assert "client state: matches" in capsys.readouterr().out


def test_plot_writes_png_and_curve_matches_ledger(ledger_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    led, path = ledger_file
    out = tmp_path / "eps.png"
    assert main(["ledger", "plot", str(path), "-o", str(out), "--points", "8"]) == 0
    data = out.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG")
    xs, ys = epsilon_curve(led, points=8)
    assert xs[0] == 0 and ys[0] == 0.0 and xs[-1] == 80 and ys[-1] == led.epsilon()
    assert {40, 70} <= set(xs) and all(a <= b for a, b in zip(ys, ys[1:]))


@pytest.fixture
def clean_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-dpzero"])  # LightningCLI warns when pytest's argv is there too


def test_fit_help_and_print_config_show_dp_arguments(tmp_path, capsys, clean_argv):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--help"])
    assert exc.value.code == 0
    assert "--trainer.strategy" in capsys.readouterr().out
    cfg = tmp_path / "run.yaml"
    cfg.write_text("""\
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_dpzero.DPDeepSpeedStrategy
    init_args:
      stage: 3
      noise_multiplier: 1.1
      clipping: all-layer
      offload_optimizer: true
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
""")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(cfg), "--print_config"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for line in ("class_path: lightning_dpzero.DPDeepSpeedStrategy", "noise_multiplier: 1.1", "max_grad_norm: 1.0",
                 "clipping: all-layer", "poisson_sampling: true", "secure_mode: false", "stage: 3",
                 "offload_optimizer: true"):  # the last one is forwarded to DeepSpeedStrategy by **kwargs
        assert line in out, line


@pytest.mark.parametrize("init_args, callback_args, bad", [
    ("      loss_reduction: avg\n", "", "loss_reduction"),
    ("      clipping: flat\n", "", "clipping"),
    ("      clipping_fn: clamp\n", "", "clipping_fn"),
    ("", "        accountant: gdp\n", "accountant"),
    ("", "        on_budget_exhausted: warn\n", "on_budget_exhausted"),
    ("", "        accounting_worker: gpu\n", "accounting_worker"),
], ids=["loss_reduction", "clipping", "clipping_fn", "accountant", "on_budget_exhausted", "accounting_worker"])
def test_a_bad_string_option_fails_when_the_config_is_parsed(tmp_path, capsys, clean_argv, init_args, callback_args,
                                                              bad):
    """--print_config builds nothing: only the Literal types of the signatures can refuse the value here."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""\
trainer:
  accelerator: cpu
  strategy:
    class_path: lightning_dpzero.DPDeepSpeedStrategy
    init_args:
      noise_multiplier: 1.0
{init_args}  callbacks:
    - class_path: lightning_dpzero.PrivacyAccountantCallback
      init_args:
        delta: 1.0e-5
{callback_args}model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
""")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(cfg), "--print_config"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert f'Parser key "{bad}"' in err and "Expected a typing.Literal[" in err, err


def test_registered_strategy_name_parses(capsys, clean_argv):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--trainer.strategy=dp_deepspeed_stage_3",
              "--model=lightning.pytorch.demos.boring_classes.BoringModel", "--print_config"])
    assert exc.value.code == 0
    assert "strategy: dp_deepspeed_stage_3" in capsys.readouterr().out


def test_plot_without_matplotlib_says_so(ledger_file, tmp_path, capsys, monkeypatch):
    _, path = ledger_file
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert main(["ledger", "plot", str(path), "-o", str(tmp_path / "eps.png")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err


def test_closed_stdout_pipe_exits_quietly(ledger_file):
    """`lightning-dpzero ledger show ... | head`: the reader goes away; no BrokenPipeError traceback."""
    import subprocess

    _, path = ledger_file
    code = "import sys; from lightning_dpzero.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "ledger", "show", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written (imports take seconds)
    _, err = proc.communicate(timeout=300)
    err = err.decode()
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert proc.returncode == 141


@pytest.mark.parametrize("q, sigma, steps, error", [(0.01, 1.0, 10**15, "OverflowError"),
                                                     (0.01, 1e300, 5, "OverflowError"),
                                                     (0.5, 1e-300, 5, "ZeroDivisionError")])
@pytest.mark.parametrize("command", [["show"], ["show", "--json"], ["verify"]])
def test_a_ledger_with_absurd_numbers_gets_a_clear_message(tmp_path, capsys, q, sigma, steps, error, command):
    ledger = PrivacyLedger(delta=1e-5, dataset_size=100)
    ledger.charge(q, sigma, steps=steps)
    ledger.save(tmp_path / "privacy_ledger.json")
    assert main(["ledger", *command, str(tmp_path / "privacy_ledger.json")]) == 1
    err = capsys.readouterr().err
    runs = re.escape(f"(q={q!r}, sigma={sigma!r}, steps={steps})")
    assert re.search(rf"epsilon cannot be computed for the runs {runs}.*"
                     rf"outside what dp-accounting can evaluate \({error}.*Check the entries", err), err
    assert "Traceback" not in err
