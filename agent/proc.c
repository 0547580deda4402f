/* The processes the agent starts (op_start), their output pipes or PTYs read into rings, users
 * looked up in the sandbox's /etc/passwd, and reaping (loop.h). */
#define _GNU_SOURCE
#include "loop.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

void proc_close_fd(struct proc *p, int *fd)
{
	if (*fd >= 0) {
		if (fd != &p->in_fd)
			epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
		close(*fd);
		*fd = -1;
	}
}

/* Processes freed during the current batch of events, their memory released after it (free_gone):
 * a later event of the batch may still carry the address of one's output watch (`out_w`), and a
 * process started later in the batch must not get that address. */
static struct proc *gone;

void proc_free(struct proc *p)
{
	for (struct proc **l = &procs; *l; l = &(*l)->next)
		if (*l == p) {
			*l = p->next;
			break;
		}
	proc_close_fd(p, &p->out_fd);
	proc_close_fd(p, &p->err_fd);
	proc_close_fd(p, &p->in_fd);
	ring_free(&p->ring);
	free(p->cmd);
	free(p->tag);
	p->next = gone;
	gone = p;
}

void proc_free_gone(void)
{
	while (gone) {
		struct proc *p = gone;
		gone = p->next;
		free(p);
	}
}

/* The process and its output have ended: tell its followers; free it if it was released. */
static void proc_ended(struct proc *p)
{
	pid_t pid = p->pid;
	p->exited = 1;
	pump_followers(pid);
	if ((p = find_proc(pid)) && p->release && !followed(pid))
		proc_free(p);
}

/* --- output: rings within their bounds, writers held while a follower catches up ------------ */

/* The offset from which `p`'s output must stay: the least position of its followers (they have yet
 * to send the rest), or UINT64_MAX when nobody follows it. */
static uint64_t kept_from(const struct proc *p)
{
	uint64_t from = UINT64_MAX;
	for (struct conn *c = conns; c; c = c->next)
		if (c->state == C_STREAM && c->output && c->pid == p->pid && c->pos < from)
			from = c->pos;
	return from;
}

/* Hold every ring together within `ring_total`: the ring holding the most gives its oldest chunk,
 * until within, or until all that is left is followers' unsent output and each ring's newest chunk. */
static void rings_fit(void)
{
	while (rings_used > ring_total) {
		struct proc *big = NULL;
		for (struct proc *q = procs; q; q = q->next)
			if ((!big || q->ring.used > big->ring.used) && ring_droppable(&q->ring, kept_from(q)))
				big = q;
		if (!big)
			return;
		ring_drop_oldest(&big->ring);
	}
}

/* Whether `p`'s pipes may be read now. With no follower, always: its oldest output makes room
 * (counted in `dropped`; E2B's envd keeps nothing of a process nobody is connected to). With one,
 * while what it has yet to send stays under the ring's size and the rings' total has room (or it
 * is under RING_FLOOR); else the process's writes wait on its full pipe, back-pressure from the
 * follower, as E2B's connected stream gets every chunk. */
static int room(const struct proc *p, uint64_t keep)
{
	if (keep == UINT64_MAX)
		return 1;
	uint64_t from = keep > p->ring.start ? keep : p->ring.start;
	uint64_t unsent = from >= p->ring.end ? 0 : p->ring.end - from;
	return unsent < p->ring.cap && (unsent < RING_FLOOR || rings_used < ring_total);
}

/* Watch `p`'s pipes again, or stop (out of the epoll set: a pipe whose writer left would report
 * EPOLLHUP even with no event asked). */
static void set_reading(struct proc *p, int on)
{
	p->paused = !on;
	if (p->out_fd >= 0)
		watch_fd(p->out_fd, &p->out_w, EPOLLIN, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL);
	if (p->err_fd >= 0)
		watch_fd(p->err_fd, &p->err_w, EPOLLIN, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL);
}

void readers_resume(void)
{
	for (struct proc *p = procs; p; p = p->next)
		if (p->paused && room(p, kept_from(p)))
			set_reading(p, 1);
}

/* Read what a process's pipe or PTY holds into its ring; returns 0 at end of file. At most `budget`
 * bytes, so one busy writer cannot starve the loop; with `hold`, only while `room` says so (else
 * the process is paused until readers_resume). */
int drain(struct proc *p, int *fd, char stream, size_t budget, int hold)
{
	uint64_t keep = kept_from(p);
	while (budget) {
		if (hold && !room(p, keep)) {
			set_reading(p, 0);
			return 1;
		}
		ssize_t n = read(*fd, readbuf, sizeof(readbuf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return 1;
		if (n <= 0) { /* EOF (a PTY's relay ended) */
			proc_close_fd(p, fd);
			if (p->pty && p->reaped && !p->exited)
				proc_ended(p);
			return 0;
		}
		ring_append(&p->ring, stream, readbuf, (size_t)n, keep);
		rings_fit();
		if (p->max && p->ring.end > p->max && !p->reaped)
			kill(-p->pid, SIGKILL); /* its client takes no more than that (the end says it went past) */
		budget = (size_t)n > budget ? 0 : budget - (size_t)n;
	}
	return 1;
}

/* Look `user` (a name or a number) up in the sandbox's /etc/passwd: no NSS in a static binary.
 * -1 with errno EINVAL (no such user) or ENAMETOOLONG (a home longer than `home_len`: never cut). */
static int lookup_user(const char *user, uid_t *uid, gid_t *gid, char *home, size_t home_len)
{
	char line[1024], *end;
	long num = strtol(user, &end, 10);
	int numeric = *user && !*end;
	FILE *f = fopen("/etc/passwd", "re");

	snprintf(home, home_len, "/");
	if (f) {
		while (fgets(line, sizeof(line), f)) {
			char *fld[7] = {0};
			char *s = line;
			for (int i = 0; i < 7 && s; i++) {
				fld[i] = s;
				s = strchr(s, ':');
				if (s)
					*s++ = 0;
			}
			if (!fld[5])
				continue;
			if (numeric ? atol(fld[2]) == num : !strcmp(fld[0], user)) {
				*uid = (uid_t)atol(fld[2]);
				*gid = (gid_t)atol(fld[3]);
				int long_home = snprintf(home, home_len, "%s", fld[5]) >= (int)home_len;
				fclose(f);
				if (long_home) {
					errno = ENAMETOOLONG;
					return -1;
				}
				return 0;
			}
		}
		fclose(f);
	}
	if (!numeric) {
		errno = EINVAL;
		return -1;
	}
	*uid = (uid_t)num;
	*gid = (gid_t)num;
	return 0;
}

int become(const char *user, char *home, size_t home_len)
{
	uid_t uid;
	gid_t gid;

	if (lookup_user(user, &uid, &gid, home, home_len) < 0)
		return -1;
	if (setgroups(1, &gid) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
		return -1;
	return 0;
}

/* `user`'s uid and gid in the sandbox's /etc/passwd: 0, or -1 if it has none. */
int user_ids(const char *user, uid_t *uid, gid_t *gid)
{
	char home[512];

	return lookup_user(user, uid, gid, home, sizeof(home));
}

/* A forked child's fresh start: default signals, nothing of the agent's open but `keep` fds
 * (moved to 3, 4, ...). */
void child_reset(const int *keep, int n)
{
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	for (int s = 1; s < NSIG; s++)
		sigaction(s, &dfl, NULL);
	sigprocmask(SIG_UNBLOCK, &handled, NULL);
	int moved[4];
	for (int i = 0; i < n; i++)
		moved[i] = fcntl(keep[i], F_DUPFD_CLOEXEC, 16 + i);
	for (int i = 0; i < n; i++)
		dup2(moved[i], 3 + i);
	close_range(3 + (unsigned)n, ~0U, 0);
	/* Dumpable again (the exec would make it so anyway), now that it holds none of the agent's
	 * descriptors: a non-dumpable process's /proc/self files belong to the root of its mm's user
	 * namespace, which for an agent CRIU restored is the host's, so the write below would fail. */
	prctl(PR_SET_DUMPABLE, 1);
	/* What the agent forks is the OOM killer's first choice (1000: the largest such process goes
	 * first, whatever PID 1 holds), so the sandbox's memory limit kills a user's process, never
	 * PID 1. Raising one's own value needs no privilege, inside a user namespace too; the host
	 * lowers PID 1's to -1000 where it may (runc.py `_spare_agent`). */
	int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
	if (oom >= 0) {
		(void)!write(oom, "1000", 4);
		close(oom);
	}
}

static void exec_child(const struct fields *f, int report)
{
	const char *argv[1024];
	int argc = 0;
	const char *v, *it = NULL;
	char home[PATH_MAX] = "/";
	const char *user = field_get(f, "user", NULL);
	int err;

	if (user && *user && become(user, home, sizeof(home)) < 0)
		goto fail;
	if (user && *user) {
		setenv("HOME", home, 1);
		setenv("USER", user, 1);
	}
	while ((v = field_get(f, "env", &it)))
		putenv((char *)v);
	v = field_get(f, "cwd", NULL);
	if (v && *v ? chdir(v) < 0 : chdir(home) < 0 && chdir("/") < 0) /* a home may not exist */
		goto fail;
	if ((v = field_get(f, "cmd", NULL))) {
		argv[argc++] = "/bin/sh";
		argv[argc++] = "-c";
		argv[argc++] = v;
	} else {
		it = NULL;
		while (argc < 1023 && (v = field_get(f, "arg", &it)))
			argv[argc++] = v;
	}
	argv[argc] = NULL;
	if (argc == 0) {
		errno = EINVAL;
		goto fail;
	}
	execvp(argv[0], (char *const *)argv);
fail:
	err = errno;
	(void)!write(report, &err, sizeof(err));
	_exit(127);
}

/* Close whichever of `n` descriptors are open (-1: not), leaving them -1. */
static void close_fds(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		if (fds[i] >= 0) {
			close(fds[i]);
			fds[i] = -1;
		}
}

/* A failed start: close what `op_start` opened (pipes, the PTY's master) and answer `err`. */
static void start_failed(struct conn *c, int *fds, int n, int err, const char *what)
{
	char msg[256];

	close_fds(fds, n);
	snprintf(msg, sizeof(msg), "%s: %s", what, strerror(err));
	reply_error(c, err, msg);
}

void op_start(struct conn *c)
{
	/* every descriptor op_start may open, so one call closes them on any failure */
	int fds[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
	int *out = fds, *errp = fds + 2, *in = fds + 4, *report = fds + 6, *master_fd = fds + 8;
	int use_stdin = field_num(&c->f, "stdin", 0) != 0;
	const char *pty = field_get(&c->f, "pty", NULL);
	struct winsize ws = {.ws_row = 24, .ws_col = 80};
	char slave_name[64] = "";

	if (pty) {
		/* The child opens the slave itself, after setsid, so the terminal is its session's own
		 * (CRIU refuses to dump a controlling terminal its session inherited); the master goes
		 * to the relay (pty.c), forked after the child, and the agent keeps none of it. */
		sscanf(pty, "%hux%hu", &ws.ws_row, &ws.ws_col);
		*master_fd = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (*master_fd < 0 || grantpt(*master_fd) < 0 || unlockpt(*master_fd) < 0 ||
		    ptsname_r(*master_fd, slave_name, sizeof(slave_name)) != 0 ||
		    ioctl(*master_fd, TIOCSWINSZ, &ws) < 0) {
			start_failed(c, fds, 9, errno, "cannot open a pty");
			return;
		}
	} else if (pipe2(out, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0 ||
		   (use_stdin && pipe2(in, O_CLOEXEC) < 0)) {
		start_failed(c, fds, 9, errno, "cannot make pipes");
		return;
	}
	if (pipe2(report, O_CLOEXEC) < 0) {
		start_failed(c, fds, 9, errno, "cannot make a pipe");
		return;
	}
	pid_t pid = fork();
	if (pid == 0) {
		/* stdio first (the pipes and PTY are >= 3 in the agent), then a process group of its own,
		 * so a signal to the group reaches what it starts. Only a PTY process gets a session (its
		 * terminal needs one): a session whose leader died is one CRIU must fake with a helper task,
		 * and with one the restore of the agent's bound socket fails (setns EINVAL); a process group
		 * in the agent's session is what `cmd &` orphans are left in. */
		int nul = open("/dev/null", O_RDWR), slave = -1;
		if (pty) {
			setsid();
			slave = open(slave_name, O_RDWR); /* a session leader's first tty: its controlling one */
			if (slave < 0) {
				int e = errno;
				(void)!write(report[1], &e, sizeof(e));
				_exit(127);
			}
		} else {
			setpgid(0, 0);
		}
		dup2(slave >= 0 ? slave : in[0] >= 0 ? in[0] : nul, 0);
		dup2(slave >= 0 ? slave : out[1], 1);
		dup2(slave >= 0 ? slave : errp[1], 2);
		int keep[] = {report[1]};
		child_reset(keep, 1);
		fcntl(3, F_SETFD, FD_CLOEXEC); /* closed by a successful exec: the agent's sign */
		exec_child(&c->f, 3);
	}
	int fork_err = errno;
	/* the child's ends */
	close_fds(&report[1], 1);
	close_fds(&out[1], 1);
	close_fds(&errp[1], 1);
	close_fds(&in[0], 1);
	int err = 0;
	ssize_t got = pid < 0 ? 0 : read(report[0], &err, sizeof(err)); /* EOF: it exec'd */
	if (pid < 0 || got == (ssize_t)sizeof(err)) {
		if (pid > 0)
			waitpid(pid, NULL, 0);
		start_failed(c, fds, 9, pid < 0 ? fork_err : err, "cannot start the process");
		return;
	}
	close_fds(&report[0], 1);
	if (pty) {
		int e = pty_relay(*master_fd, &out[0], &in[1]) < 0 ? errno : 0;
		close_fds(master_fd, 1);
		if (e) {
			kill(-pid, SIGKILL); /* reaped by the loop, as an orphan would be */
			start_failed(c, fds, 9, e, "cannot start the terminal's relay");
			return;
		}
	}
	const char *cmd = field_get(&c->f, "cmd", NULL), *arg = field_get(&c->f, "arg", NULL);
	const char *tag = field_get(&c->f, "tag", NULL);
	struct proc *p = calloc(1, sizeof(*p));
	if (p && (!(p->cmd = strdup(cmd ? cmd : arg ? arg : "")) || !(p->tag = strdup(tag ? tag : "")))) {
		free(p->cmd);
		free(p);
		p = NULL;
	}
	if (!p) { /* started, but PID 1 cannot keep its record: end it rather than lose track of it */
		kill(-pid, SIGKILL); /* reaped by the loop, as an orphan would be */
		start_failed(c, fds, 9, ENOMEM, "cannot record the process");
		return;
	}
	p->pid = pid;
	p->pty = pty != NULL;
	snprintf(p->tty, sizeof(p->tty), "%s", slave_name);
	p->out_fd = out[0];
	p->err_fd = errp[0];
	p->in_fd = in[1];
	p->release = field_num(&c->f, "release", 0) != 0;
	long long max = field_num(&c->f, "max", 0);
	p->max = max > 0 ? (uint64_t)max : 0;
	long long cap = field_num(&c->f, "ring", (long long)ring_default);
	p->ring.cap = cap > 0 ? (size_t)cap : ring_default;
	p->ring.tail_link = &p->ring.head;
	p->out_w = (struct watch){K_OUT, p};
	p->err_w = (struct watch){K_ERR, p};
	fcntl(p->out_fd, F_SETFL, O_NONBLOCK);
	watch_fd(p->out_fd, &p->out_w, EPOLLIN, EPOLL_CTL_ADD);
	if (p->err_fd >= 0) {
		fcntl(p->err_fd, F_SETFL, O_NONBLOCK);
		watch_fd(p->err_fd, &p->err_w, EPOLLIN, EPOLL_CTL_ADD);
	}
	p->next = procs;
	procs = p;

	size_t mark;
	ob_fields_begin(&c->out, field_num(&c->f, "follow", 0) ? F_INFO : F_RESULT, &mark);
	ob_field(&c->out, "pid", "%d", pid);
	ob_fields_end(&c->out, mark);
	if (field_num(&c->f, "follow", 0)) {
		c->state = C_STREAM;
		c->pid = pid;
		c->pos = 0;
		c->output = 1;
		pump(c);
	} else {
		finish(c);
	}
}

void reaped(pid_t pid, int status)
{
	for (struct conn *c = conns; c; c = c->next)
		if (c->state == C_WORKER && c->worker == pid) {
			conn_close(c);
			return;
		}
	struct proc *p = find_proc(pid);
	if (!p)
		return; /* an orphan re-parented to us: reaping it was the point */
	p->status = status;
	p->exit_time = time(NULL);
	p->reaped = 1;
	if (p->pty && p->out_fd >= 0) {
		/* What it wrote may still be in the terminal: the relay hands it over, then ends (the
		 * output's end of file, in drain, ends the process here). */
		proc_close_fd(p, &p->in_fd);
		return;
	}
	/* What it wrote before exiting is in the pipe already (at most the pipe's size: a held writer
	 * was waiting on it): take it, held or not, before announcing the end. */
	if (p->out_fd >= 0)
		drain(p, &p->out_fd, F_STDOUT, 1u << 20, 0);
	if (p->err_fd >= 0)
		drain(p, &p->err_fd, F_STDERR, 1u << 20, 0);
	proc_ended(p);
}
