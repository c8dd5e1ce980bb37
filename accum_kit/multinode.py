"""``accum-kit nodes``: the ``accelerate launch`` line each node runs, by hand or from SLURM's variables.

A job on M machines runs one ``accelerate launch`` per machine; they differ
only in ``--machine_rank``. Every machine names the same main address and port
(machine 0's), and ``--num_processes`` is the total over all machines
(Accelerate's convention). :func:`node_commands` prints the M lines;
:func:`slurm_command` builds this node's line from the variables SLURM sets in
every task of an allocation, so that ``examples/slurm/accum_kit.sbatch`` can
``srun`` one launch per node (the layout of Accelerate's own SLURM example,
``examples/slurm/submit_multinode.sh`` in the accelerate repository).

SLURM variables read (https://slurm.schedmd.com/sbatch.html, "OUTPUT
ENVIRONMENT VARIABLES"): ``SLURM_NNODES`` (machines), ``SLURM_NODEID`` (this
node's index, the machine rank), ``SLURM_JOB_NODELIST`` (its first host is the
main node), and the GPUs per node from ``SLURM_GPUS_ON_NODE`` (or
``SLURM_GPUS_PER_NODE``, e.g. ``4`` or ``a100:4``). Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from . import checks
from .errors import UsageError

DEFAULT_PORT = 29500  # torchrun's and Accelerate's default main process port
DEFAULT_CONFIG = "accelerate_configs/multi_node.yaml"
#: Seconds a node waits for the others at the rendezvous before it fails (torchrun's
#: static rendezvous reads ``timeout`` from ``--rdzv_conf``; its default is 900 s).
DEFAULT_RDZV_TIMEOUT = 300


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, e.g. ``gpu[003-004,010]`` -> ``gpu003``, ``a1,b2`` -> ``a1``.

    Only the first name is expanded (that is the main node); the full syntax is
    ``scontrol show hostnames``'s job.

    Raises:
        UsageError: an empty or malformed list.
    """
    m = re.match(r"\s*([^,\[\s]+)(?:\[([0-9]+)[^\]]*\])?", nodelist or "")
    if not m:
        raise UsageError("SLURM_JOB_NODELIST", f"cannot read a host from {nodelist!r}",
                         "run inside a SLURM allocation or pass --main_process_ip")
    return m.group(1) + (m.group(2) or "")


def _check_counts(num_machines: int, num_processes: int, port: int) -> None:
    checks.at_least("--num_machines", num_machines)
    checks.at_least("--num_processes", num_processes)
    checks.at_least("--main_process_port", port)
    if num_processes % num_machines:
        raise UsageError("--num_processes", f"{num_processes} processes do not split evenly over {num_machines} machines",
                         "pass the TOTAL over all machines, a multiple of --num_machines")


def launch_command(*, num_machines: int, machine_rank: int, num_processes: int, main_process_ip: str,
                   main_process_port: int = DEFAULT_PORT, config_file: str = DEFAULT_CONFIG,
                   rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT, command: list[str] = ()) -> list[str]:
    """The ``accelerate launch`` argv of one machine.

    Args:
        num_machines: machines in the job.
        machine_rank: this machine's index, 0 on the main machine.
        num_processes: processes over ALL machines (e.g. 2 nodes x 4 GPUs = 8).
        main_process_ip, main_process_port: machine 0's address and a free TCP port there.
        config_file: the Accelerate config with the fields common to every machine.
        rdzv_timeout: seconds to wait for every machine at the rendezvous.
        command: the script and its flags, e.g. ``["examples/train.py", "--output_dir", "runs/x"]``.

    Raises:
        UsageError: a count below 1, a rank outside ``[0, num_machines)``, or
            processes not divisible by machines.
    """
    _check_counts(num_machines, num_processes, main_process_port)
    if not 0 <= machine_rank < num_machines:
        raise UsageError("--machine_rank", f"must be in [0, {num_machines}) (got {machine_rank})",
                         "number the machines 0 to num_machines - 1")
    return ["accelerate", "launch", "--config_file", config_file, "--num_machines", str(num_machines),
            "--machine_rank", str(machine_rank), "--num_processes", str(num_processes),
            "--main_process_ip", main_process_ip, "--main_process_port", str(main_process_port),
            "--rdzv_conf", f"timeout={rdzv_timeout}", *command]


def node_commands(num_machines: int, num_processes: int, main_process_ip: str, **kwargs) -> list[list[str]]:
    """One :func:`launch_command` per machine rank 0 .. num_machines - 1 (same keyword arguments)."""
    _check_counts(num_machines, num_processes, kwargs.get("main_process_port", DEFAULT_PORT))
    return [launch_command(num_machines=num_machines, machine_rank=r, num_processes=num_processes,
                           main_process_ip=main_process_ip, **kwargs) for r in range(num_machines)]


def _gpus_per_node(env) -> int:
    raw = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE") or ""
    m = re.search(r"(\d+)\s*$", raw.split(",")[0])
    if not m:
        raise UsageError("SLURM_GPUS_ON_NODE", f"cannot read GPUs per node from {raw!r}",
                         "request GPUs with #SBATCH --gpus-per-node=N")
    return int(m.group(1))


def slurm_command(env=None, **kwargs) -> list[str]:
    """This node's :func:`launch_command`, from SLURM's variables in ``env`` (default ``os.environ``).

    ``MAIN_PROCESS_IP`` / ``MAIN_PROCESS_PORT`` in ``env`` override the first
    host of the node list and the default port. Other keyword arguments go to
    :func:`launch_command`.

    Raises:
        UsageError: a SLURM variable is missing or unreadable (named in the error).
    """
    env = os.environ if env is None else env
    for var in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"):
        if not env.get(var):
            raise UsageError(var, "is not set", "run inside a SLURM allocation (sbatch / srun)")
    machines = int(env["SLURM_NNODES"])
    kwargs.setdefault("main_process_port", int(env.get("MAIN_PROCESS_PORT", DEFAULT_PORT)))
    return launch_command(num_machines=machines, machine_rank=int(env["SLURM_NODEID"]),
                          num_processes=machines * _gpus_per_node(env),
                          main_process_ip=env.get("MAIN_PROCESS_IP") or first_host(env["SLURM_JOB_NODELIST"]),
                          **kwargs)


# --------------------------------------------------------------------------- command line


@dataclass
class NodesArguments:
    """Flags of ``accum-kit nodes [flags] -- SCRIPT [SCRIPT FLAGS]``."""

    num_machines: int = field(default=2, metadata={"help": "Machines in the job."})
    num_processes: int = field(default=8, metadata={"help": "Processes over ALL machines (Accelerate's convention)."})
    main_process_ip: str = field(default="127.0.0.1", metadata={"help": "Address of machine 0, reachable from every machine."})
    main_process_port: int = field(default=DEFAULT_PORT, metadata={"help": "A free TCP port on machine 0."})
    config_file: str = field(default=DEFAULT_CONFIG, metadata={"help": "Accelerate config shared by every machine."})
    rdzv_timeout: int = field(default=DEFAULT_RDZV_TIMEOUT, metadata={"help": "Seconds to wait for all machines at start-up."})
    from_slurm: bool = field(default=False, metadata={"help": "Build THIS node's line from SLURM's variables instead."})
    exec: bool = field(default=False, metadata={"help": "Run the line (replaces this process) instead of printing it."})
    command: list[str] = field(default_factory=list, metadata={"help": "The script and its flags, after --."})

    def __post_init__(self):
        checks.at_least("--rdzv_timeout", self.rdzv_timeout)


ARGUMENTS = NodesArguments
DESCRIPTION = ("Print the accelerate launch line of every machine of a multi-node job (or, with --from_slurm, "
               "this node's line from SLURM's variables; with --exec, run it). Example: accum-kit nodes "
               "--num_machines 2 --num_processes 8 --main_process_ip 10.0.0.1 -- examples/train.py --output_dir runs/x")


def run_command(args: NodesArguments) -> int:
    """Print (or exec) the launch line(s); 0 on success, bad values raise UsageError."""
    common = dict(main_process_port=args.main_process_port, config_file=args.config_file,
                  rdzv_timeout=args.rdzv_timeout, command=args.command)
    if args.from_slurm:
        lines = [slurm_command(**common)]
    else:
        lines = node_commands(args.num_machines, args.num_processes, args.main_process_ip, **common)
    if args.exec:
        if len(lines) != 1:
            raise UsageError("--exec", "runs one node's line only", "add --from_slurm, or drop --exec and run each line on its node")
        os.execvp(lines[0][0], lines[0])
    for rank, line in enumerate(lines):
        prefix = "" if args.from_slurm else f"# machine {rank}\n"
        print(prefix + shlex.join(line))
    return 0
