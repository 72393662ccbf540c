"""Several processes, as on a multi-node cluster: 2 local processes x 4 simulated CPU devices,
started through launch.train with explicit --coordinator flags, against 1 process x 8 devices.
FSDP spans both processes, each loads only its half of every batch, only process 0 logs, all
write the checkpoint; a preempted pair resumes; a lost process stops the other quickly."""

import signal
import time

import pytest

from tests.helpers.processes import (
    STEPS,
    logged_losses,
    start_pair,
    start_train,
    wait_all,
    wait_for_step,
)
from tests.helpers.small import seed_data
from titanax import distributed
from titanax.process_guard import describe_lost_process


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
    work = seed_data(tmp_path_factory.mktemp("one"))
    proc = start_train(work, "run", "--host-devices", "8")
    assert wait_all([proc]) == [0], proc.log_path.read_text()[-3000:]
    losses = logged_losses(work)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_two_processes_log_the_losses_of_one(tmp_path, one_process_losses):
    work = seed_data(tmp_path)
    procs = start_pair(work, "run")
    codes = wait_all(procs)
    logs = [p.log_path.read_text() for p in procs]
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "2 processes (jax.distributed), 4 local device(s) each" in logs[0]
    assert "fsdp=8" in logs[0] and "over 8 cpu device(s)" in logs[0]
    assert "titanax:" not in logs[1].replace("titanax: starting", "")  # only process 0 logs
    assert "step 0: val_loss" in logs[0] and "val_loss" not in logs[1]
    got = logged_losses(work)
    assert sorted(got) == sorted(one_process_losses)
    for step, want in one_process_losses.items():
        assert got[step] == pytest.approx(want, rel=2e-5), step
    # Every process wrote its shards of the final checkpoint; process 0 its manifest.
    assert (work / "checkpoints" / str(STEPS) / "titanax_manifest.json").is_file()


def test_preempted_pair_saves_together_and_resumes(tmp_path, one_process_losses):
    work = seed_data(tmp_path)
    procs = start_pair(work, "first", extra=["--set=train.steps=400"])
    wait_for_step(procs, work, 2)
    procs[1].send_signal(signal.SIGTERM)  # one process gets the notice; both must stop
    codes = wait_all(procs)
    log0 = procs[0].log_path.read_text()
    assert codes == [75, 75], log0[-3000:]
    assert "preempted (a stop signal sent to another process): saved a checkpoint" in log0
    stopped = int(log0.split("saved a checkpoint at step ")[1].split()[0])
    assert (work / "checkpoints" / str(stopped) / "titanax_manifest.json").is_file()

    procs = start_pair(work, "second", extra=[f"--set=train.steps={stopped + 2}"])
    codes = wait_all(procs)
    log0 = procs[0].log_path.read_text()
    assert codes == [0, 0], log0[-3000:]
    assert f"at step {stopped}" in log0
    assert sorted(logged_losses(work)) == list(range(1, stopped + 3))


def test_lost_process_stops_the_other_with_a_clear_error(tmp_path):
    work = seed_data(tmp_path)
    procs = start_pair(work, "run", extra=["--set=train.steps=100000"])
    wait_for_step(procs, work, 2)
    procs[1].kill()
    t0 = time.time()
    code = wait_all(procs[:1], timeout=120)[0]
    took = time.time() - t0
    tail = procs[0].log_path.read_text()[-2000:]
    assert code == 1, tail
    assert "error: lost process 1" in tail and "process 0 of 2 stopped too" in tail, tail
    # the one line, without the traceback and XLA's fatal logs that came before it
    text = procs[0].log_path.read_text()
    assert text.count("error:") == 1 and "Traceback" not in text and "\nF1" not in text, tail
    assert took < 120


def test_resolve_processes_from_flags_env_and_slurm():
    assert distributed.resolve_processes(env={}) is None
    spec = distributed.resolve_processes("h:1234", 2, 1, env={})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.local_device_ids) == \
        ("h:1234", 2, 1, None)
    spec = distributed.resolve_processes(env={"TITANAX_COORDINATOR": "a:1",
                                              "TITANAX_NUM_PROCESSES": "4",
                                              "TITANAX_PROCESS_ID": "3"})
    assert spec.process_id == 3 and spec.source == "TITANAX_* env"
    slurm = {"SLURM_JOB_ID": "4100", "SLURM_STEP_NODELIST": "gpu[007-008]",
             "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    spec = distributed.resolve_processes(env=slurm)
    # One task per node sees all its GPUs; the port is jax's job-id rule (61440 + id % 4096).
    assert spec.coordinator == "gpu007:61444" and spec.local_device_ids is None
    assert spec.process_id == 1 and spec.num_processes == 2
    per_gpu = {**slurm, "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    assert distributed.resolve_processes(env=per_gpu).local_device_ids == (1,)
    assert distributed.resolve_processes(
        env={**per_gpu, "JAX_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids == (0, 1)
    assert distributed.resolve_processes(env={**slurm, "SLURM_NTASKS": "1"}) is None


@pytest.mark.parametrize("env,message", [
    ({"TITANAX_COORDINATOR": "a:1", "TITANAX_NUM_PROCESSES": "2"}, "TITANAX_PROCESS_ID missing"),
    ({"JAX_COORDINATOR_ADDRESS": "a", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "is not HOST:PORT"),
    ({"TITANAX_COORDINATOR": "a:1", "TITANAX_NUM_PROCESSES": "2", "TITANAX_PROCESS_ID": "2"},
     "outside [0, 2)"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2"}, "not started by srun"),
])
def test_bad_process_settings_name_the_fix(env, message):
    with pytest.raises(distributed.DistributedError, match=message.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        distributed.resolve_processes(env=env)


def test_lost_process_is_named_from_the_coordination_error():
    tail = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
            "The tasks have crashed.")
    assert describe_lost_process(tail).startswith("process 1 ")
    assert describe_lost_process("E: Task 3 heartbeat timeout. This indicates") \
        .startswith("process 3 ")
    assert "coordinator" in describe_lost_process(
        "Either the leader task was preempted/died/restarted unexpectedly")
    assert describe_lost_process("Segmentation fault") is None
