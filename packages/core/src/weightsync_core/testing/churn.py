"""A connection churner, for security tests: what an attacker would run against a listener,
written in C so that the process under test, not the attacker's interpreter, is the
bottleneck.

:func:`build_churner` compiles it once per machine (with the system's ``cc``) and returns
its path. Run it as ``churner HOST PORT[,PORT...] MODE AMOUNT``:

- ``close N``: open and close ``N`` connections to each port, 256 at a time without waiting
  for each (closed with a reset, as a scanner does: no ``TIME_WAIT`` is left to exhaust the
  attacker's ports); a connection the listener did not complete within 100 ms counts as
  refused;
- ``hold N``: open ``N`` connections to each port and hold them until SIGTERM (child
  processes share the work where one process may not hold so many descriptors);
- ``seconds S``: open and close connections to every port, as fast as it can, for ``S``
  seconds, the same way (started before the listener, it churns from the moment it
  listens).

It prints ``ready`` once it has started (``hold``: once every connection is open) and, when
done or on SIGTERM, one JSON line: ``{"connections": ..., "refused": ..., "seconds": ...}``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build_churner"]

_SOURCE = r"""
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop = 0;
static void on_term(int sig) { (void)sig; stop = 1; }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static int open_one(struct sockaddr_in *addr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)addr, sizeof(*addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static void reset_close(int fd) {
  struct linger l = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

/* Start up to `batch` connections to `addr` at once (non-blocking), wait up to 100 ms for
   them, then reset every one: the connections that completed count, the rest are refused. */
#define BATCH 256
static void churn_batch(struct sockaddr_in *addr, long batch, long *connections,
                        long *refused) {
  struct pollfd fds[BATCH];
  int n = 0;
  for (long k = 0; k < batch && k < BATCH; k++) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) break;
    if (connect(fd, (struct sockaddr *)addr, sizeof(*addr)) != 0 && errno != EINPROGRESS) {
      close(fd);
      (*refused)++;
      continue;
    }
    fds[n].fd = fd;
    fds[n].events = POLLOUT;
    fds[n].revents = 0;
    n++;
  }
  double deadline = now() + 0.1;
  int open = n;
  while (open > 0 && now() < deadline) {
    if (poll(fds, n, 10) < 0 && errno != EINTR) break;
    open = 0;
    for (int k = 0; k < n; k++) {
      if (fds[k].fd < 0) continue;
      if (fds[k].revents) {
        int error = 0;
        socklen_t size = sizeof(error);
        getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error == 0) (*connections)++; else (*refused)++;
        reset_close(fds[k].fd);
        fds[k].fd = -1;
      } else {
        open++;
      }
    }
  }
  for (int k = 0; k < n; k++)
    if (fds[k].fd >= 0) { reset_close(fds[k].fd); (*refused)++; }
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s HOST PORT[,PORT...] close|hold|seconds AMOUNT\n", argv[0]);
    return 2;
  }
  struct sockaddr_in addrs[64];
  int nports = 0;
  char *ports = strdup(argv[2]);
  for (char *p = strtok(ports, ","); p && nports < 64; p = strtok(NULL, ",")) {
    memset(&addrs[nports], 0, sizeof(addrs[nports]));
    addrs[nports].sin_family = AF_INET;
    addrs[nports].sin_port = htons((unsigned short)atoi(p));
    inet_pton(AF_INET, argv[1], &addrs[nports].sin_addr);
    nports++;
  }
  const char *mode = argv[3];
  double amount = atof(argv[4]);
  signal(SIGTERM, on_term);
  signal(SIGINT, on_term);
  long connections = 0, refused = 0;
  double start = now();
  if (strcmp(mode, "close") == 0) {
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < nports; i++) {
      long before = connections + refused;
      while (connections + refused - before < (long)amount && !stop)
        churn_batch(&addrs[i], (long)amount - (connections + refused - before), &connections,
                    &refused);
    }
  } else if (strcmp(mode, "seconds") == 0) {
    printf("ready\n");
    fflush(stdout);
    while (!stop && now() - start < amount) {
      for (int i = 0; i < nports; i++) churn_batch(&addrs[i], BATCH, &connections, &refused);
    }
  } else if (strcmp(mode, "hold") == 0) {
    struct rlimit limit;
    getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
    long per_child = (long)limit.rlim_cur - 64;
    long total = (long)amount * nports;
    int children = (int)((total + per_child - 1) / per_child);
    int pipes[2];
    if (pipe(pipes) != 0) return 1;
    pid_t pids[256];
    for (int c = 0; c < children && c < 256; c++) {
      pids[c] = fork();
      if (pids[c] == 0) {
        long mine = 0, failed = 0;
        for (long k = (long)c * per_child; k < total && k < (long)(c + 1) * per_child; k++) {
          int fd = open_one(&addrs[k % nports]);
          if (fd < 0) failed++; else mine++;
        }
        long report[2] = {mine, failed};
        if (write(pipes[1], report, sizeof(report)) != sizeof(report)) _exit(1);
        while (!stop) pause();
        _exit(0);
      }
    }
    for (int c = 0; c < children && c < 256; c++) {
      long report[2];
      if (read(pipes[0], report, sizeof(report)) == sizeof(report)) {
        connections += report[0];
        refused += report[1];
      }
    }
    printf("ready\n");
    fflush(stdout);
    while (!stop) pause();
    for (int c = 0; c < children && c < 256; c++) {
      kill(pids[c], SIGTERM);
      waitpid(pids[c], NULL, 0);
    }
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  printf("{\"connections\": %ld, \"refused\": %ld, \"seconds\": %.3f}\n", connections, refused,
         now() - start);
  fflush(stdout);
  return 0;
}
"""


def build_churner() -> Path:
    """The churner's executable, compiled with the system's C compiler on first use (cached
    in the temporary folder under the hash of its source).

    Raises:
        RuntimeError: no C compiler (``cc``) on this machine, or it failed.
    """
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"weightsync-churner-{digest}"
    if binary.exists():
        return binary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the connection churner needs a C compiler (cc) on this machine")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "churner.c"
        source.write_text(_SOURCE)
        built = Path(folder) / "churner"
        result = subprocess.run([compiler, "-O2", "-o", str(built), str(source)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the connection churner failed: {result.stderr}")
        shutil.move(str(built), binary)  # atomic within one file system, else a copy
    return binary
