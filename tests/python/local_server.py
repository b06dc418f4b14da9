"""What the Python tests that start the server binary on loopback share."""
import socket
import subprocess


def free_port():
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_mib(pid, field):
    """A live process's `field` of /proc/PID/status (a size in kB) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib(pid):
    """A live process's peak resident memory (VmHWM) in MiB."""
    return _status_mib(pid, "VmHWM")


def resident_mib(pid):
    """A live process's resident memory now (VmRSS) in MiB."""
    return _status_mib(pid, "VmRSS")


def stop(proc, timeout):
    """Ends a server process still running: SIGTERM, then SIGKILL after `timeout` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
