"""A real single-node Slurm cluster for the tests, from Debian's packages.

Five daemons, each started in the foreground as a child of the test process and stopped by its
PID: munged (private key and socket), mariadbd (private datadir, TCP on 127.0.0.1 only),
slurmdbd (accounting, so that `sacct` answers: the Snakemake slurm executor polls with it),
slurmctld and slurmd (one node: this host's short name, its real CPU count and memory). Every
state, spool, log and PID file lives under one temporary directory; every port is a free one on
127.0.0.1 (slurm.conf's AccountingStoragePass names munged's socket for the slurmdbd connection,
AuthInfo for the rest). The only files written outside that directory are /etc/slurm/slurm.conf and
/etc/slurm/slurmdbd.conf (Slurm's commands and the executor plugin read the former from there);
both carry MARKER, a config without it is never overwritten, and stop() removes them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurm-wlm", "slurmdbd", "munge", "mariadb-server"]
COMMANDS = ["munged", "munge", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch",
            "srun", "sacct", "sacctmgr", "sinfo", "squeue", "scancel", "scontrol"]
CONF_DIR = Path("/etc/slurm")
MARKER = "# Written by videosft's tests/workflow/slurm_cluster.py for a throwaway test cluster."


def missing_commands() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [name for name in COMMANDS if shutil.which(name, path=path) is None]


def not_installed() -> str | None:
    """Why the cluster cannot be started here, or None. The tests never install anything: the
    packages come from .ci/install-slurm.sh, which CI runs and which you may run yourself."""
    missing = missing_commands()
    if not missing:
        return None
    return (f"Slurm, munge or MariaDB commands missing ({', '.join(missing)}); to run these tests, install "
            f"Debian's {' '.join(PACKAGES)} (as root: bash .ci/install-slurm.sh)")


def conf_in_the_way() -> str | None:
    """A Slurm config we did not write (a real cluster's) is never touched."""
    for name in ("slurm.conf", "slurmdbd.conf"):
        path = CONF_DIR / name
        if path.exists() and MARKER not in path.read_text(errors="replace"):
            return f"{path} exists and was not written by these tests: not replacing a real cluster's config"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def real_memory_mb() -> int:
    """RealMemory as slurmd itself measures it (a larger value would leave the node invalid)."""
    output = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    for field in output.split():
        if field.startswith("RealMemory="):
            return int(field.split("=", 1)[1])
    raise RuntimeError(f"slurmd -C printed no RealMemory: {output!r}")


class ClusterError(RuntimeError):
    pass


class SlurmCluster:
    """start() brings the cluster up (about a minute); stop() takes all of it down, always."""

    def __init__(self, root: Path, partition: str = "videosft-test", account: str = "videosft",
                 name: str = "videosft"):
        self.root = Path(root)
        self.partition = partition
        self.account = account
        self.name = name
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.memory_mb = 0
        self.processes: dict[str, subprocess.Popen] = {}
        self.ports = {}
        self.wrote_conf = False

    # --- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def munge_socket(self) -> Path:
        return self.path("munge", "munge.socket")

    # --- commands ------------------------------------------------------------------------
    def run(self, *command: str, timeout: int = 60, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise ClusterError(f"`{' '.join(command)}` exited {result.returncode}: {result.stdout}{result.stderr}"
                               f"\n{self.logs()}")
        return result

    def sacct(self, job_ids, fields: str = "JobID,JobName,State,ExitCode") -> list[dict]:
        """One row per job (allocations only, no steps), fields as named."""
        names = fields.split(",")
        result = self.run("sacct", "-X", "-n", "-P", "-j", ",".join(map(str, job_ids)), "-o", fields)
        return [dict(zip(names, line.split("|"))) for line in result.stdout.splitlines() if line.strip()]

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.path("log").glob("*.log")) if self.path("log").exists() else []:
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # --- daemons -------------------------------------------------------------------------
    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.path("log", f"{name}.out.log"), "ab")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait(self, name: str, ready, timeout: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.processes.get(name)
            if process is not None and process.poll() is not None:
                raise ClusterError(f"{name} exited with {process.returncode} while starting\n{self.logs()}")
            try:
                if ready():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.5)
        raise ClusterError(f"{name} not ready after {timeout} s {what}\n{self.logs()}")

    def start(self) -> None:
        reason = conf_in_the_way()
        if reason:
            raise ClusterError(reason)
        for directory in ("munge", "mysql", "state", "spool", "log", "run"):
            self.path(directory).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged refuses keys and sockets under group/other-writable dirs
        self.memory_mb = real_memory_mb()
        self.ports = {name: free_port() for name in ("mysql", "slurmdbd", "slurmctld", "slurmd")}
        self._start_munge()
        self._start_mariadb()
        self._write_conf()
        self._start_slurmdbd()
        self._register_account()
        self._start_slurmctld()
        self._start_slurmd()

    def _start_munge(self) -> None:
        key = self.path("munge", "munge.key")
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(self.path("munge"), 0o700)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.path('munge', 'munged.pid')}",
                               f"--seed-file={self.path('munge', 'munged.seed')}",
                               f"--log-file={self.path('log', 'munged.log')}"])
        self._wait("munged", lambda: self.munge_socket.exists()
                   and subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True,
                                      timeout=10).returncode == 0)

    def _start_mariadb(self) -> None:
        datadir = self.path("mysql", "data")
        options = ["--no-defaults", f"--datadir={datadir}", "--user=root", "--innodb-log-file-size=8M"]
        self.run("mariadb-install-db", *options, "--auth-root-authentication-method=normal", "--skip-test-db",
                 "--skip-name-resolve", timeout=120)
        self._spawn("mariadbd", ["mariadbd", *options, "--bind-address=127.0.0.1", f"--port={self.ports['mysql']}",
                                 f"--socket={self.path('mysql', 'mysqld.sock')}",
                                 f"--pid-file={self.path('mysql', 'mysqld.pid')}",
                                 f"--log-error={self.path('log', 'mariadbd.log')}",
                                 "--skip-name-resolve", "--skip-log-bin", "--innodb-buffer-pool-size=64M",
                                 "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
                                 "--innodb-lock-wait-timeout=900"])
        self._wait("mariadbd", lambda: port_open(self.ports["mysql"]), timeout=90)

    def _write_conf(self) -> None:
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        slurm_conf = f"""{MARKER}
ClusterName={self.name}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={self.ports['slurmctld']}
SlurmdPort={self.ports['slurmd']}
SlurmUser=root
SlurmdUser=root
{auth}CredType=cred/munge
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool', 'slurmd')}
SlurmctldPidFile={self.path('run', 'slurmctld.pid')}
SlurmdPidFile={self.path('run', 'slurmd.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', 'slurmd.log')}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.ports['slurmdbd']}
AccountingStoragePass={self.munge_socket}
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerType=sched/backfill
MinJobAge=600
InactiveLimit=0
KillWait=5
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName={self.partition} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        slurmdbd_conf = f"""{MARKER}
{auth}DbdHost={self.host}
DbdAddr=127.0.0.1
DbdPort={self.ports['slurmdbd']}
SlurmUser=root
LogFile={self.path('log', 'slurmdbd.log')}
PidFile={self.path('run', 'slurmdbd.pid')}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.ports['mysql']}
StorageUser=root
StorageLoc=slurm_acct_db
"""
        CONF_DIR.mkdir(parents=True, exist_ok=True)
        self.wrote_conf = True
        (CONF_DIR / "slurm.conf").write_text(slurm_conf)
        dbd = CONF_DIR / "slurmdbd.conf"
        dbd.write_text(slurmdbd_conf)
        os.chmod(dbd, 0o600)  # slurmdbd refuses a config others can read

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait("slurmdbd", lambda: port_open(self.ports["slurmdbd"]), timeout=120)

    def _register_account(self) -> None:
        self.run("sacctmgr", "-i", "add", "cluster", self.name)
        self.run("sacctmgr", "-i", "add", "account", self.account, f"cluster={self.name}",
                 "description=videosft tests", "organization=videosft")
        self.run("sacctmgr", "-i", "add", "user", "root", f"account={self.account}", f"cluster={self.name}")

    def _start_slurmctld(self) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._wait("slurmctld", lambda: subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                                                       timeout=10).stdout.count("UP") > 0)

    def _start_slurmd(self) -> None:
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.host])
        self._wait("slurmd", lambda: subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                                                    text=True, timeout=10).stdout.strip() == "idle",
                   what="(node not idle)")

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop each daemon by its PID (TERM, then KILL), remove the configs."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", f"--partition={self.partition}"], capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "-h", "-p", self.partition], capture_output=True, text=True,
                                       timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(1)
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        shutil.rmtree(self.path("mysql"), ignore_errors=True)  # ~100 MB of InnoDB files; the logs stay
        if self.wrote_conf:
            for name in ("slurm.conf", "slurmdbd.conf"):
                path = CONF_DIR / name
                if path.exists() and MARKER in path.read_text(errors="replace"):
                    path.unlink()
            self.wrote_conf = False
