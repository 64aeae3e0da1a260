"""A connection churner, for security tests: what an attacker would run against a listener,
written in C so that the process under test, not the attacker's interpreter, is the
bottleneck.

:func:`build_churner` compiles it once per machine (with the system's ``cc``) and returns
its path. Run it as ``churner HOST PORT[,PORT...] MODE AMOUNT``:

- ``close N``: open and close ``N`` connections to each port, 256 at a time without waiting
  for each (closed with a reset, as a scanner does: no ``TIME_WAIT`` is left to exhaust the
  attacker's ports); a connection the listener did not complete within 100 ms counts as
  refused;
- ``hold N``: open ``N`` connections to each port, all at once, and hold them until SIGTERM
  (child processes share the work where one process may not hold so many descriptors); a
  connection the listener did not complete within two seconds (one SYN retry) counts as
  refused;
- ``seconds S``: open and close connections to every port, as fast as it can, for ``S``
  seconds, the same way (started before the listener, it churns from the moment it
  listens);
- ``watch S``: the same, at the given ports (``0``: none) and at every TCP port that starts
  listening on this host after the churner started (read from ``/proc/net/tcp`` every
  20 ms, as any local user can): a sync's rendezvous store and transport listeners are
  churned from the moment they listen, without the attacker knowing their ports. With
  ``CHURN_PIDS`` (comma-separated process ids) in its environment, only the ports those
  processes listen on (their sockets in ``/proc/PID/fd``): the processes under test, not
  the other tests running on the host.

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
#include <dirent.h>
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

/* The socket inodes of the processes named in CHURN_PIDS (comma-separated), up to `max`;
   -1 where CHURN_PIDS is unset or empty (every process). */
static int pid_sockets(unsigned long *out, int max) {
  const char *pids = getenv("CHURN_PIDS");
  if (!pids || !*pids) return -1;
  char *copy = strdup(pids), *saved = NULL;
  int n = 0;
  for (char *pid = strtok_r(copy, ",", &saved); pid; pid = strtok_r(NULL, ",", &saved)) {
    char folder[64];
    snprintf(folder, sizeof(folder), "/proc/%s/fd", pid);
    DIR *dir = opendir(folder);
    if (!dir) continue;
    struct dirent *entry;
    while (n < max && (entry = readdir(dir)) != NULL) {
      char link[384], target[64];
      snprintf(link, sizeof(link), "%s/%s", folder, entry->d_name);
      ssize_t length = readlink(link, target, sizeof(target) - 1);
      if (length <= 0) continue;
      target[length] = 0;
      unsigned long inode;
      if (sscanf(target, "socket:[%lu]", &inode) == 1) out[n++] = inode;
    }
    closedir(dir);
  }
  free(copy);
  return n;
}

/* The IPv4 TCP ports listening on this host now (from /proc/net/tcp), up to `max`; where
   `ninodes` >= 0, only those of sockets among `inodes`. */
static int listening_ports(int *out, int max, const unsigned long *inodes, int ninodes) {
  FILE *file = fopen("/proc/net/tcp", "r");
  if (!file) return 0;
  char line[512];
  int n = 0;
  if (!fgets(line, sizeof(line), file)) { fclose(file); return 0; }
  while (n < max && fgets(line, sizeof(line), file)) {
    unsigned int ip, port, remote_ip, remote_port, state;
    unsigned long inode;
    if (sscanf(line, " %*d: %8X:%4X %8X:%4X %2X %*X:%*X %*X:%*X %*X %*u %*u %lu", &ip, &port,
               &remote_ip, &remote_port, &state, &inode) != 6 || state != 0x0A)
      continue;
    int mine = ninodes < 0;
    for (int i = 0; i < ninodes && !mine; i++) mine = inodes[i] == inode;
    if (mine) out[n++] = (int)port;
  }
  fclose(file);
  return n;
}

static int contains(const int *ports, int n, int port) {
  for (int i = 0; i < n; i++) if (ports[i] == port) return 1;
  return 0;
}

static void reset_close(int fd) {
  struct linger l = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

/* Start connections k = first .. last - 1 (to addrs[k % nports]), up to `batch` at once
   without waiting for each, and wait up to `wait` seconds for them: those the listener
   completed count in `completed` and are kept open (`keep`) or reset, the rest count in
   `failed` and are reset. Returns the k it got to. */
#define BATCH 256
static long connect_batch(struct sockaddr_in *addrs, int nports, long first, long last,
                          long batch, double wait, int keep, long *completed, long *failed) {
  struct pollfd *fds = calloc((size_t)batch, sizeof(struct pollfd));
  if (!fds) { (*failed) += last - first; return last; }
  int n = 0;
  long k = first;
  while (k < last && n < batch) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in *addr = &addrs[k++ % nports];
    if (fd < 0) { (*failed)++; break; }  /* out of descriptors: wait for this batch */
    if (connect(fd, (struct sockaddr *)addr, sizeof(*addr)) != 0 && errno != EINPROGRESS) {
      close(fd);
      (*failed)++;
      continue;
    }
    fds[n].fd = fd;
    fds[n].events = POLLOUT;
    fds[n].revents = 0;
    n++;
  }
  double deadline = now() + wait;
  int open = n;
  while (open > 0 && now() < deadline) {
    if (poll(fds, n, 10) < 0 && errno != EINTR) break;
    open = 0;
    for (int i = 0; i < n; i++) {
      if (fds[i].fd < 0) continue;
      if (fds[i].revents) {
        int error = 0;
        socklen_t size = sizeof(error);
        getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error == 0) (*completed)++; else (*failed)++;
        if (error != 0 || !keep) reset_close(fds[i].fd);
        fds[i].fd = -1;  /* settled: kept open or closed */
      } else {
        open++;
      }
    }
  }
  for (int i = 0; i < n; i++)
    if (fds[i].fd >= 0) { reset_close(fds[i].fd); (*failed)++; }
  free(fds);
  return k;
}

static void set_address(struct sockaddr_in *addr, const char *host, int port) {
  memset(addr, 0, sizeof(*addr));
  addr->sin_family = AF_INET;
  addr->sin_port = htons((unsigned short)port);
  inet_pton(AF_INET, host, &addr->sin_addr);
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s HOST PORT[,PORT...] close|hold|seconds|watch AMOUNT\n", argv[0]);
    return 2;
  }
  struct sockaddr_in addrs[64];
  int given[64];
  int ngiven = 0;
  char *ports = strdup(argv[2]);
  for (char *p = strtok(ports, ","); p && ngiven < 64; p = strtok(NULL, ","))
    if (atoi(p) > 0) given[ngiven++] = atoi(p);
  int nports = ngiven;
  for (int i = 0; i < nports; i++) set_address(&addrs[i], argv[1], given[i]);
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
        connect_batch(&addrs[i], 1, 0, (long)amount - (connections + refused - before),
                      BATCH, 0.1, 0, &connections, &refused);
    }
  } else if (strcmp(mode, "seconds") == 0) {
    printf("ready\n");
    fflush(stdout);
    while (!stop && now() - start < amount) {
      for (int i = 0; i < nports; i++)
        connect_batch(&addrs[i], 1, 0, BATCH, BATCH, 0.1, 0, &connections, &refused);
    }
  } else if (strcmp(mode, "watch") == 0) {
    static int initial[65536], now_listening[65536];
    static unsigned long inodes[65536];
    int ninitial = listening_ports(initial, 65536, NULL, -1);
    printf("ready\n");
    fflush(stdout);
    double looked = 0;
    while (!stop && now() - start < amount) {
      if (now() - looked >= 0.02) {  /* the given ports, then every port new since start */
        looked = now();
        int ninodes = pid_sockets(inodes, 65536);
        int nnow = listening_ports(now_listening, 65536, inodes, ninodes);
        nports = ngiven;
        for (int k = 0; k < nnow && nports < 64; k++) {
          int port = now_listening[k];
          if (contains(initial, ninitial, port) || contains(given, ngiven, port)) continue;
          int seen = 0;
          for (int i = ngiven; i < nports; i++)
            if (ntohs(addrs[i].sin_port) == port) seen = 1;
          if (seen) continue;
          set_address(&addrs[nports++], argv[1], port);
        }
      }
      if (nports == 0) { usleep(1000); continue; }
      for (int i = 0; i < nports; i++)
        connect_batch(&addrs[i], 1, 0, BATCH, BATCH, 0.1, 0, &connections, &refused);
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
        long last = (long)(c + 1) * per_child < total ? (long)(c + 1) * per_child : total;
        /* all at once: a full backlog costs one SYN retry (a second), not one per batch */
        for (long k = (long)c * per_child; k < last; )
          k = connect_batch(addrs, nports, k, last, last - k, 2.0, 1, &mine, &failed);
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
