"""mltuner.launch._env: detecting rank, world size and master from a launcher's variables."""

from __future__ import annotations

import os
import socket

import pytest

import mltuner

from mltuner.launch._env import (
    ProcessEnv,
    detect_environment,
    first_slurm_host,
    free_port,
    is_loopback,
    iter_slurm_hosts,
)

SECRET = "s3cret-for-these-tests"


def mltuner_vars(rank: int = 1, world: int = 3, local: int | None = None, addr: str = "127.0.0.1",
                 port: int = 29400) -> dict[str, str]:
    return {"MLTUNER_RANK": str(rank), "MLTUNER_WORLD_SIZE": str(world),
            "MLTUNER_LOCAL_RANK": str(rank if local is None else local),
            "MLTUNER_MASTER_ADDR": addr, "MLTUNER_MASTER_PORT": str(port)}


def torchrun_vars(rank: int = 2, world: int = 4, local: int = 0, addr: str = "10.0.0.5",
                  port: int = 29500) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


# ---- each source ------------------------------------------------------------------------------

def test_no_launcher_means_a_single_loopback_process() -> None:
    assert detect_environment({}) == ProcessEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
        bind_host="127.0.0.1", secret=None, source="single")


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in mltuner_vars(rank=2, world=5).items():
        monkeypatch.setenv(name, value)
    found = detect_environment()
    assert (found.source, found.rank, found.world_size) == ("mltuner", 2, 5)


def test_mltuner_launcher_variables() -> None:
    found = detect_environment({**mltuner_vars(rank=1, world=3, port=29400), "MLTUNER_SECRET": SECRET})
    assert found == ProcessEnv(rank=1, world_size=3, local_rank=1, master_addr="127.0.0.1",
                               master_port=29400, bind_host="127.0.0.1", secret=SECRET,
                               source="mltuner")


def test_torchrun_variables() -> None:
    found = detect_environment({**torchrun_vars(), "MLTUNER_SECRET": SECRET})
    assert found == ProcessEnv(rank=2, world_size=4, local_rank=0, master_addr="10.0.0.5",
                               master_port=29500, bind_host="0.0.0.0", secret=SECRET,
                               source="torchrun")


def test_torchrun_agent_store_gives_a_key_per_run_and_restart() -> None:
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "run-7",
             "TORCHELASTIC_RESTART_COUNT": "2"}
    found = detect_environment({**torchrun_vars(addr="localhost"), **agent})
    assert found.torch_store_key == "mltuner/run-7/2/rendezvous"
    assert (found.master_addr, found.master_port) == ("localhost", 29500)  # the store's address
    off = detect_environment({**torchrun_vars(addr="localhost"), **agent, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert off.torch_store_key is None
    # Only torchrun's own variables count: under mltuner launch the key is ignored.
    assert detect_environment({**mltuner_vars(rank=0, world=2), **agent}).torch_store_key is None


@pytest.mark.parametrize(("value", "kind"), [("", "auto"), ("tcp", "tcp"), (" IPC ", "ipc"), ("auto", "auto")])
def test_transport_setting(value: str, kind: str) -> None:
    assert detect_environment({"MLTUNER_TRANSPORT": value}).transport == kind


def test_unknown_transport_names_the_variable() -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match="MLTUNER_TRANSPORT='udp' is not one of auto, tcp, ipc"):
        detect_environment({"MLTUNER_TRANSPORT": "udp"})


def test_slurm_takes_the_first_node_and_a_port_from_the_job_id() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-09],cpu1", "SLURM_JOB_ID": "123456",
           "MLTUNER_SECRET": SECRET}
    found = detect_environment(env)
    assert found == ProcessEnv(rank=5, world_size=8, local_rank=1, master_addr="gpu07",
                               master_port=20000 + 123456 % 20000, bind_host="0.0.0.0",
                               secret=SECRET, source="slurm")


def test_slurm_prefers_the_step_node_list_and_master_variables() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
           "SLURM_STEP_NODELIST": "b[3-4]", "SLURM_JOB_NODELIST": "a[1-4]",
           "MLTUNER_SECRET": SECRET}
    assert detect_environment(env).master_addr == "b3"
    assert detect_environment(env).master_port == 20007
    overridden = detect_environment({**env, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (overridden.master_addr, overridden.master_port) == ("head", 4000)


def test_slurm_without_a_port_source_is_an_error() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "n1", "MLTUNER_SECRET": SECRET}
    with pytest.raises(ValueError, match="MASTER_PORT or SLURM_JOB_ID"):
        detect_environment(env)


def test_slurm_with_a_bad_node_list_names_the_variable() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "n[1-2", "MLTUNER_SECRET": SECRET}
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        detect_environment(env)


def test_openmpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "6000",
           "MLTUNER_SECRET": SECRET}
    assert detect_environment(env) == ProcessEnv(
        rank=3, world_size=4, local_rank=1, master_addr="node1", master_port=6000,
        bind_host="0.0.0.0", secret=SECRET, source="openmpi")


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_openmpi_needs_master_variables_exported(missing: str) -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "6000"}
    del env[missing]
    with pytest.raises(ValueError, match=rf"{missing} must be set.*mpirun -x MASTER_ADDR=.*-x MASTER_PORT="):
        detect_environment(env)


def test_openmpi_single_process_needs_no_master() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    found = detect_environment(env)
    assert (found.source, found.world_size, found.master_addr, found.master_port) == (
        "openmpi", 1, "127.0.0.1", 0)


# ---- precedence and overrides -----------------------------------------------------------------

def test_mltuner_variables_win_over_torchrun_slurm_and_mpi() -> None:
    env = {**torchrun_vars(rank=3, world=4), **mltuner_vars(rank=0, world=2),
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    found = detect_environment(env)
    assert (found.source, found.rank, found.world_size) == ("mltuner", 0, 2)


def test_torchrun_wins_over_slurm() -> None:
    env = {**torchrun_vars(rank=1, world=2, addr="127.0.0.1"),
           "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"}
    found = detect_environment(env)
    assert (found.source, found.rank, found.world_size) == ("torchrun", 1, 2)


def test_slurm_wins_over_openmpi() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9",
           "MASTER_ADDR": "localhost",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    found = detect_environment(env)
    assert (found.source, found.rank) == ("slurm", 1)


def test_bind_host_override_and_loopback_default() -> None:
    assert detect_environment(mltuner_vars(addr="localhost")).bind_host == "127.0.0.1"
    assert detect_environment(mltuner_vars(addr="::1")).bind_host == "::1"
    env = {**mltuner_vars(addr="10.1.2.3"), "MLTUNER_SECRET": SECRET}
    assert detect_environment(env).bind_host == "0.0.0.0"
    env["MLTUNER_BIND_HOST"] = "10.1.2.3"
    assert detect_environment(env).bind_host == "10.1.2.3"


def test_secret_is_read_but_never_shown_in_repr() -> None:
    found = detect_environment({**mltuner_vars(), "MLTUNER_SECRET": SECRET})
    assert found.secret == SECRET
    assert SECRET not in repr(found)
    assert detect_environment(mltuner_vars()).secret is None


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["MLTUNER_RANK", "MLTUNER_WORLD_SIZE", "MLTUNER_LOCAL_RANK",
                                  "MLTUNER_MASTER_PORT"])
def test_non_integer_values_name_the_variable(name: str) -> None:
    env = {**mltuner_vars(), name: "two"}
    with pytest.raises(ValueError, match=rf"{name}='two' is not an integer"):
        detect_environment(env)


@pytest.mark.parametrize("name", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"])
def test_non_integer_slurm_values_name_the_variable(name: str) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5",
           "MASTER_ADDR": "127.0.0.1", name: "x1"}
    with pytest.raises(ValueError, match=rf"{name}='x1' is not an integer"):
        detect_environment(env)


@pytest.mark.parametrize("rank", [-1, 3, 7])
def test_rank_outside_the_world_is_an_error(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"MLTUNER_RANK={rank} is outside \[0, 3\)"):
        detect_environment(mltuner_vars(rank=rank, world=3, local=0))


def test_torchrun_rank_error_names_torchruns_variable() -> None:
    with pytest.raises(ValueError, match=r"^RANK=4 is outside \[0, 4\)"):
        detect_environment(torchrun_vars(rank=4, world=4, addr="127.0.0.1"))


@pytest.mark.parametrize("world", [0, -2, 4097, 10**9])
def test_world_size_outside_its_bounds_is_an_error(world: int) -> None:
    with pytest.raises(ValueError, match=rf"MLTUNER_WORLD_SIZE must be in 1..4096 .*, got {world}"):
        detect_environment(mltuner_vars(rank=0, world=world))


def test_local_rank_outside_the_world_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"MLTUNER_LOCAL_RANK=5 is outside"):
        detect_environment(mltuner_vars(rank=0, world=2, local=5))


@pytest.mark.parametrize("port", [0, -1, 65536, 100000])
def test_port_outside_the_valid_range_is_an_error(port: int) -> None:
    with pytest.raises(ValueError, match=rf"MLTUNER_MASTER_PORT={port} is not a port in 1\.\.65535"):
        detect_environment(mltuner_vars(world=2, rank=0, port=port))


def test_port_zero_is_allowed_for_a_single_process() -> None:
    assert detect_environment(mltuner_vars(rank=0, world=1, port=0)).master_port == 0


def test_a_job_of_several_processes_needs_a_master_address() -> None:
    with pytest.raises(ValueError, match="MLTUNER_MASTER_ADDR must name rank 0's host"):
        detect_environment(mltuner_vars(rank=0, world=2, addr=" "))
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "3"}
    with pytest.raises(ValueError, match="MASTER_ADDR or SLURM_STEP_NODELIST"):
        detect_environment(slurm)


@pytest.mark.parametrize("missing", ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_incomplete_torchrun_variables_are_an_error(missing: str) -> None:
    env = torchrun_vars(addr="127.0.0.1")
    del env[missing]
    with pytest.raises(ValueError, match=rf"{missing} missing \(.*torchrun sets all of them"):
        detect_environment(env)


def test_incomplete_mltuner_variables_are_an_error() -> None:
    env = mltuner_vars()
    del env["MLTUNER_MASTER_PORT"]
    with pytest.raises(ValueError, match="MLTUNER_MASTER_PORT missing"):
        detect_environment(env)


@pytest.mark.parametrize("addr", ["10.0.0.5", "node01", "0.0.0.0"])
def test_a_non_loopback_master_needs_a_secret(addr: str) -> None:
    with pytest.raises(ValueError, match=r"set MLTUNER_SECRET to the same random string on every "
                                         r"process.*secrets\.token_hex\(32\)"):
        detect_environment(torchrun_vars(addr=addr))
    assert detect_environment({**torchrun_vars(addr=addr), "MLTUNER_SECRET": SECRET}).secret == SECRET


def test_an_empty_secret_counts_as_none() -> None:
    with pytest.raises(ValueError, match="MLTUNER_SECRET"):
        detect_environment({**torchrun_vars(addr="10.0.0.5"), "MLTUNER_SECRET": ""})


def test_a_non_loopback_bind_host_needs_a_secret() -> None:
    env = {**mltuner_vars(), "MLTUNER_BIND_HOST": "0.0.0.0"}
    with pytest.raises(ValueError, match=r"MLTUNER_BIND_HOST='0\.0\.0\.0'.*MLTUNER_SECRET"):
        detect_environment(env)


# ---- helpers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "LOCALHOST", "::1",
                                  "[::1]", "::ffff:127.0.0.1"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "192.168.1.1", "node01", "::", "", "128.0.0.1"])
def test_non_loopback_addresses(host: str) -> None:
    assert not is_loopback(host)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 1 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.skipif(not os.path.exists(EPHEMERAL_RANGE), reason="the kernel states no ephemeral port range")
def test_free_port_is_below_the_ephemeral_range() -> None:
    """Where a socket bound to port 0 or a connection's own end could not take it
    between the choice and rank 0's bind."""
    with open(EPHEMERAL_RANGE, encoding="ascii") as ports:
        low = int(ports.read().split()[0])
    chosen = {free_port() for _ in range(20)}
    assert all(port < low for port in chosen), (chosen, low)
    assert len(chosen) > 1  # drawn at random: two launchers rarely meet


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("a,b,c", ["a", "b", "c"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("n[3,1]", ["n3", "n1"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("r[1-2]n[0-1]", ["r1n0", "r1n1", "r2n0", "r2n1"]),
    ("[5-6]", ["5", "6"]),
    ("gpu-a100-[01-02],cpu[1]", ["gpu-a100-01", "gpu-a100-02", "cpu1"]),
])
def test_slurm_host_lists_expand(hostlist: str, hosts: list[str]) -> None:
    assert list(iter_slurm_hosts(hostlist)) == hosts
    assert first_slurm_host(hostlist) == hosts[0]


def test_first_host_of_a_huge_range_is_cheap() -> None:
    assert first_slurm_host("n[0000000-9999999]") == "n0000000"


@pytest.mark.parametrize("hostlist", ["", "n[1-2", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "n[1-]",
                                      "a,,b", "n[]"])
def test_malformed_slurm_host_lists_are_errors(hostlist: str) -> None:
    with pytest.raises(ValueError):
        first_slurm_host(hostlist)


def test_a_short_secret_is_refused_where_other_machines_can_connect() -> None:
    # The CURVE keys derive from the secret: one of a few characters is guessed, and a guess joins the job.
    with pytest.raises(ValueError, match="MLTUNER_SECRET holds 1 characters; a job that other machines can reach"):
        detect_environment({**torchrun_vars(), "MLTUNER_SECRET": "a"})
    with pytest.raises(ValueError, match="MLTUNER_SECRET holds 1 characters"):
        detect_environment({**mltuner_vars(), "MLTUNER_SECRET": "a", "MLTUNER_BIND_HOST": "0.0.0.0"})
    assert detect_environment({**mltuner_vars(), "MLTUNER_SECRET": "a"}).secret == "a"  # loopback only: any
