/*
 * k3sys-agent: PID 1 of every k3sys sandbox (docs/sandbox-agent.md).
 *
 * One thread, one epoll loop: the listening unix socket, client connections, the output pipes or
 * PTY masters of the processes it started, and a signalfd (SIGCHLD, SIGTERM). Every process the
 * sandbox's user starts is a child of this PID 1, so a CRIU dump of the container captures it, and
 * its output lives here, in a bounded ring per process (ring.c), so it survives the dump with it.
 * Requests that may block (file operations, stdin writes) run in a forked worker per request; the
 * loop only watches the worker's connection and kills the worker when the client goes away.
 *
 * Usage: k3sys-agent [--socket PATH] [--ring BYTES] [--retain SECONDS]
 */
#define _GNU_SOURCE
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
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

#define VERSION "1"
#define OUT_HIGH (256u << 10) /* stop pumping output to a connection with this much unsent */

enum kind { K_LISTEN, K_SIGNAL, K_CONN, K_OUT, K_ERR };
enum cstate { C_REQ, C_STREAM, C_WORKER, C_CLOSING };

struct watch {
	enum kind kind;
	void *obj;
};

struct proc {
	struct proc *next;
	pid_t pid;
	char *cmd, *tag; /* tag: the client's name for this start ("" if none) */
	int out_fd, err_fd, in_fd; /* -1 when closed; with a PTY, out_fd = in_fd's master */
	int pty, exited, status, release;
	time_t exit_time;
	struct ring ring;
	struct watch out_w, err_w;
};

struct conn {
	struct conn *next;
	int fd;
	enum cstate state;
	struct watch w;
	/* request being read: header then exactly its payload (bytes after it stay for a worker) */
	char head[4];
	size_t got, want;
	char *req;
	struct fields f;
	struct obuf out;
	/* C_STREAM: the process followed, the next offset to send, whether output is wanted (wait
	 * wants only the end) and a deadline (ms since boot, 0 = none) */
	pid_t pid;
	uint64_t pos;
	int output;
	long long deadline;
	pid_t worker;
	pid_t release_when_sent; /* a released process freed once its end is out (not if the client left) */
	unsigned events;
};

static int ep;
static struct proc *procs;
static struct conn *conns;
static size_t ring_default = 16u << 20;
static long retain_s = 600;
static char readbuf[CHUNK];
static sigset_t handled;

static long long now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

static void watch_fd(int fd, struct watch *w, unsigned events, int op)
{
	struct epoll_event e = {.events = events, .data.ptr = w};
	epoll_ctl(ep, op, fd, &e);
}

static struct proc *find_proc(pid_t pid)
{
	for (struct proc *p = procs; p; p = p->next)
		if (p->pid == pid)
			return p;
	return NULL;
}

/* --- connections -------------------------------------------------------------------------- */

static void proc_free(struct proc *p);

static void conn_close(struct conn *c)
{
	for (struct conn **l = &conns; *l; l = &(*l)->next)
		if (*l == c) {
			*l = c->next;
			break;
		}
	close(c->fd); /* also drops it from the epoll set */
	free(c->req);
	free(c->out.buf);
	free(c);
}

static void conn_want(struct conn *c, unsigned events)
{
	if (events != c->events) {
		watch_fd(c->fd, &c->w, events, EPOLL_CTL_MOD);
		c->events = events;
	}
}

/* Send what is queued without blocking; a finished request closes once all of it is out. Returns
 * 0 when the connection is gone (closed here), 1 otherwise. */
static int conn_flush(struct conn *c)
{
	while (c->out.off < c->out.len) {
		ssize_t w = send(c->fd, c->out.buf + c->out.off, c->out.len - c->out.off, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno == EAGAIN)
			break;
		if (w < 0) {
			conn_close(c);
			return 0;
		}
		c->out.off += (size_t)w;
	}
	if (c->out.off == c->out.len) {
		c->out.off = c->out.len = 0;
		if (c->state == C_CLOSING) {
			struct proc *p = c->release_when_sent ? find_proc(c->release_when_sent) : NULL;
			if (p)
				proc_free(p);
			conn_close(c);
			return 0;
		}
	}
	if (c->state != C_WORKER)
		conn_want(c, c->out.len ? EPOLLIN | EPOLLOUT | EPOLLRDHUP : EPOLLIN | EPOLLRDHUP);
	return 1;
}

static void finish(struct conn *c)
{
	c->state = C_CLOSING;
	conn_flush(c);
}

static void reply_error(struct conn *c, int err, const char *msg)
{
	ob_error(&c->out, err, "%s", msg);
	finish(c);
}

static void end_fields(struct obuf *o, struct proc *p)
{
	if (WIFSIGNALED(p->status))
		ob_field(o, "signal", "%d", WTERMSIG(p->status));
	ob_field(o, "exit", "%d", WIFEXITED(p->status) ? WEXITSTATUS(p->status) : 128 + WTERMSIG(p->status));
	ob_field(o, "dropped", "%llu", (unsigned long long)p->ring.dropped);
	ob_field(o, "end", "%llu", (unsigned long long)p->ring.end);
}

static int followed(pid_t pid)
{
	for (struct conn *c = conns; c; c = c->next)
		if (c->state == C_STREAM && c->pid == pid)
			return 1;
	return 0;
}

/* Move a following connection on: output from its position (a gap where the ring dropped bytes is
 * announced with an I frame), then, once the process has ended and all is sent, the R frame. */
static void pump(struct conn *c)
{
	struct proc *p = find_proc(c->pid);
	size_t mark;

	if (!p) {
		reply_error(c, ESRCH, "the process is gone (released)");
		return;
	}
	/* Up to OUT_HIGH queued at a time; while the socket takes it all at once, go on (nothing else
	 * would wake this connection: EPOLLOUT is watched only while something is queued). */
	do {
		while (c->output && c->out.len - c->out.off < OUT_HIGH) {
			if (c->pos < p->ring.start) {
				ob_fields_begin(&c->out, F_INFO, &mark);
				ob_field(&c->out, "dropped", "%llu", (unsigned long long)(p->ring.start - c->pos));
				ob_field(&c->out, "pos", "%llu", (unsigned long long)p->ring.start);
				ob_fields_end(&c->out, mark);
				c->pos = p->ring.start;
			}
			struct chunk *k = ring_find(&p->ring, c->pos);
			if (!k)
				break;
			size_t off = (size_t)(c->pos - k->pos), n = k->len - off;
			ob_frame(&c->out, k->stream, k->data + off, n);
			c->pos += n;
		}
		if (p->exited && (!c->output || c->pos >= p->ring.end)) {
			ob_fields_begin(&c->out, F_RESULT, &mark);
			end_fields(&c->out, p);
			ob_fields_end(&c->out, mark);
			c->state = C_CLOSING;
			if (p->release)
				c->release_when_sent = p->pid;
		}
		if (!conn_flush(c))
			return;
	} while (c->state == C_STREAM && c->output && c->out.len == 0 && c->pos < p->ring.end);
}

static void pump_followers(pid_t pid)
{
	struct conn *next;
	for (struct conn *c = conns; c; c = next) {
		next = c->next;
		if (c->state == C_STREAM && c->pid == pid)
			pump(c);
	}
}

/* --- processes ---------------------------------------------------------------------------- */

static void proc_close_fd(struct proc *p, int *fd)
{
	if (*fd >= 0) {
		if (fd != &p->in_fd)
			epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
		close(*fd);
		*fd = -1;
	}
}

static void proc_free(struct proc *p)
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
	free(p);
}

/* Read what a process's pipe or PTY holds into its ring; returns 0 at end of file. At most `budget`
 * bytes, so one busy writer cannot starve the loop. */
static int drain(struct proc *p, int *fd, char stream, size_t budget)
{
	while (budget) {
		ssize_t n = read(*fd, readbuf, sizeof(readbuf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return 1;
		if (n <= 0) { /* EOF, or EIO from a PTY whose other side is all closed */
			proc_close_fd(p, fd);
			return 0;
		}
		ring_append(&p->ring, stream, readbuf, (size_t)n);
		budget = (size_t)n > budget ? 0 : budget - (size_t)n;
	}
	return 1;
}

/* Look `user` (a name or a number) up in the sandbox's /etc/passwd: no NSS in a static binary. */
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
				snprintf(home, home_len, "%s", fld[5]);
				fclose(f);
				return 0;
			}
		}
		fclose(f);
	}
	if (!numeric)
		return -1;
	*uid = (uid_t)num;
	*gid = (gid_t)num;
	return 0;
}

static int become(const char *user, char *home, size_t home_len)
{
	uid_t uid;
	gid_t gid;

	if (lookup_user(user, &uid, &gid, home, home_len) < 0) {
		errno = EINVAL;
		return -1;
	}
	if (setgroups(1, &gid) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
		return -1;
	return 0;
}

/* A forked child's fresh start: default signals, nothing of the agent's open but `keep` fds
 * (moved to 3, 4, ...). */
static void child_reset(const int *keep, int n)
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
}

static void exec_child(const struct fields *f, int report)
{
	const char *argv[1024];
	int argc = 0;
	const char *v, *it = NULL;
	char home[512] = "/";
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

static void op_start(struct conn *c)
{
	int out[2] = {-1, -1}, errp[2] = {-1, -1}, in[2] = {-1, -1}, report[2];
	int master = -1, use_stdin = field_num(&c->f, "stdin", 0) != 0;
	const char *pty = field_get(&c->f, "pty", NULL);
	struct winsize ws = {.ws_row = 24, .ws_col = 80};
	char msg[256], slave_name[64] = "";

	if (pty) {
		/* Only the master here: the child opens the slave itself, after setsid, so the terminal is
		 * its session's own (CRIU refuses to dump a controlling terminal its session inherited). */
		sscanf(pty, "%hux%hu", &ws.ws_row, &ws.ws_col);
		master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0 ||
		    ptsname_r(master, slave_name, sizeof(slave_name)) != 0 || ioctl(master, TIOCSWINSZ, &ws) < 0) {
			int e = errno;
			if (master >= 0)
				close(master);
			snprintf(msg, sizeof(msg), "cannot open a pty: %s", strerror(e));
			reply_error(c, e, msg);
			return;
		}
	} else {
		if (pipe2(out, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0 || (use_stdin && pipe2(in, O_CLOEXEC) < 0)) {
			reply_error(c, errno, "cannot make pipes");
			return;
		}
	}
	if (pipe2(report, O_CLOEXEC) < 0) {
		reply_error(c, errno, "cannot make a pipe");
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
	close(report[1]);
	if (out[1] >= 0)
		close(out[1]);
	if (errp[1] >= 0)
		close(errp[1]);
	if (in[0] >= 0)
		close(in[0]);
	int err = 0;
	ssize_t got = pid < 0 ? 0 : read(report[0], &err, sizeof(err)); /* EOF: it exec'd */
	close(report[0]);
	if (pid < 0 || got == (ssize_t)sizeof(err)) {
		int e = pid < 0 ? errno : err;
		snprintf(msg, sizeof(msg), "cannot start the process: %s", strerror(e));
		close(master);
		close(out[0]);
		close(errp[0]);
		close(in[1]);
		if (pid > 0)
			waitpid(pid, NULL, 0);
		reply_error(c, e, msg);
		return;
	}
	struct proc *p = calloc(1, sizeof(*p));
	p->pid = pid;
	const char *cmd = field_get(&c->f, "cmd", NULL);
	p->cmd = strdup(cmd ? cmd : field_get(&c->f, "arg", NULL));
	const char *tag = field_get(&c->f, "tag", NULL);
	p->tag = strdup(tag ? tag : "");
	p->pty = pty != NULL;
	p->out_fd = pty ? master : out[0];
	p->err_fd = pty ? -1 : errp[0];
	p->in_fd = pty ? fcntl(master, F_DUPFD_CLOEXEC, 0) : in[1];
	p->release = field_num(&c->f, "release", 0) != 0;
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

static void reaped(pid_t pid, int status)
{
	for (struct conn *c = conns; c; c = c->next)
		if (c->state == C_WORKER && c->worker == pid) {
			conn_close(c);
			return;
		}
	struct proc *p = find_proc(pid);
	if (!p)
		return; /* an orphan re-parented to us: reaping it was the point */
	/* What it wrote before exiting is in the pipe already: take it before announcing the end. */
	if (p->out_fd >= 0)
		drain(p, &p->out_fd, F_STDOUT, 1u << 20);
	if (p->err_fd >= 0)
		drain(p, &p->err_fd, F_STDERR, 1u << 20);
	p->exited = 1;
	p->status = status;
	p->exit_time = time(NULL);
	pump_followers(pid);
	if ((p = find_proc(pid)) && p->release && !followed(pid))
		proc_free(p);
}

/* --- requests ----------------------------------------------------------------------------- */

static struct proc *need_proc(struct conn *c)
{
	pid_t pid = (pid_t)field_num(&c->f, "pid", 0);
	struct proc *p = find_proc(pid);
	char msg[64];

	if (!p) {
		snprintf(msg, sizeof(msg), "no process %d", pid);
		reply_error(c, ESRCH, msg);
	}
	return p;
}

static void ok(struct conn *c)
{
	size_t mark;
	ob_fields_begin(&c->out, F_RESULT, &mark);
	ob_fields_end(&c->out, mark);
	finish(c);
}

static void op_list(struct conn *c)
{
	size_t mark;
	for (struct proc *p = procs; p; p = p->next) {
		ob_fields_begin(&c->out, F_INFO, &mark);
		ob_field(&c->out, "pid", "%d", p->pid);
		ob_field(&c->out, "cmd", "%s", p->cmd);
		ob_field(&c->out, "tag", "%s", p->tag);
		ob_field(&c->out, "running", "%d", !p->exited);
		ob_field(&c->out, "pty", "%d", p->pty);
		if (p->exited)
			end_fields(&c->out, p);
		ob_fields_end(&c->out, mark);
	}
	ok(c);
}

/* Close connections whose client has gone (before a dump: a socket to the host is a resource CRIU
 * cannot save), killing the workers that served them. */
static void op_quiesce(struct conn *self)
{
	struct conn *next;
	for (struct conn *c = conns; c; c = next) {
		next = c->next;
		struct pollfd pfd = {.fd = c->fd, .events = POLLRDHUP};
		if (c == self || poll(&pfd, 1, 0) <= 0 || !(pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)))
			continue;
		if (c->state == C_WORKER) {
			kill(c->worker, SIGKILL);
			waitpid(c->worker, NULL, 0);
		}
		conn_close(c);
	}
	ok(self);
}

static void worker_alarm(int sig)
{
	static const char frame[] = "\0\0\0\x3bXcode=ETIMEDOUT\0errno=110\0msg=no answer within the timeout\0";
	(void)sig;
	if (!frame_sending) /* never inside a frame half sent */
		(void)!write(3, frame, sizeof(frame) - 1);
	_exit(1);
}

/* Hand the connection to a forked worker: for the file operations and stdin writes, anything that
 * may block. The loop keeps its copy only to notice the client leaving (then kills the worker). */
static void spawn_worker(struct conn *c, int in_fd)
{
	pid_t pid = fork();
	if (pid == 0) {
		int keep[] = {c->fd, in_fd};
		child_reset(keep, in_fd >= 0 ? 2 : 1);
		int fd = 3;
		struct obuf o = {0};
		char home[512];
		const char *op = c->f.buf;
		const char *user = field_get(&c->f, "user", NULL);
		long long timeout = field_num(&c->f, "timeout", 30000);
		struct itimerval t = {.it_value = {timeout / 1000, (timeout % 1000) * 1000}};

		fcntl(fd, F_SETFL, 0); /* blocking */
		/* The alarm ends a request stuck on a FIFO or a slow device; the client sees the stream end
		 * without a result and reports a timeout. */
		signal(SIGALRM, worker_alarm);
		setitimer(ITIMER_REAL, &t, NULL);
		if (user && *user && become(user, home, sizeof(home)) < 0) {
			ob_error(&o, errno, "cannot become user %s: %s", user, strerror(errno));
			flush_blocking(fd, &o);
			_exit(1);
		}
		if (!strcmp(op, "stdin")) {
			static char buf[FRAME_MAX];
			size_t n;
			int type;
			while ((type = read_frame(fd, buf, &n)) == F_DATA)
				if (write_all(4, buf + 1, n) < 0) {
					ob_error(&o, errno, "stdin: %s", strerror(errno));
					flush_blocking(fd, &o);
					_exit(1);
				}
			size_t mark;
			ob_fields_begin(&o, F_RESULT, &mark);
			ob_fields_end(&o, mark);
			flush_blocking(fd, &o);
			_exit(type == F_END ? 0 : 1);
		}
		_exit(file_op(fd, op, &c->f) < 0);
	}
	if (pid < 0) {
		reply_error(c, errno, "cannot fork a worker");
		return;
	}
	c->state = C_WORKER;
	c->worker = pid;
	conn_want(c, EPOLLRDHUP);
}

static void dispatch(struct conn *c)
{
	const char *op = c->f.buf;
	struct proc *p;
	size_t mark;

	if (!strcmp(op, "start")) {
		op_start(c);
	} else if (!strcmp(op, "connect") || !strcmp(op, "wait")) {
		if (!(p = need_proc(c)))
			return;
		const char *from = field_get(&c->f, "from", NULL);
		c->state = C_STREAM;
		c->pid = p->pid;
		c->output = !strcmp(op, "connect");
		c->pos = !from || !strcmp(from, "start") ? 0 : !strcmp(from, "now") ? p->ring.end : strtoull(from, NULL, 10);
		long long timeout = field_num(&c->f, "timeout", 0);
		c->deadline = timeout > 0 ? now_ms() + timeout : 0;
		if (c->output && !field_num(&c->f, "follow", 1) && !p->exited) {
			/* one look: what is there now, then where the next look starts */
			pump(c);
			if (c->state == C_STREAM) {
				ob_fields_begin(&c->out, F_RESULT, &mark);
				ob_field(&c->out, "running", "1");
				ob_field(&c->out, "pos", "%llu", (unsigned long long)c->pos);
				ob_field(&c->out, "dropped", "%llu", (unsigned long long)p->ring.dropped);
				ob_fields_end(&c->out, mark);
				finish(c);
			}
			return;
		}
		pump(c);
	} else if (!strcmp(op, "signal")) {
		if (!(p = need_proc(c)))
			return;
		int sig = (int)field_num(&c->f, "sig", SIGKILL);
		/* The whole process group by default (the command and what it started); setsid'd
		 * descendants have left it on purpose. */
		if (!p->exited && kill(field_num(&c->f, "group", 1) ? -p->pid : p->pid, sig) < 0)
			kill(p->pid, sig);
		ok(c);
	} else if (!strcmp(op, "stdin")) {
		if (!(p = need_proc(c)))
			return;
		if (p->in_fd < 0) {
			reply_error(c, EPIPE, "the process's stdin is closed (or was never open)");
			return;
		}
		if (field_num(&c->f, "close", 0)) {
			if (p->pty)
				(void)!write(p->in_fd, "\x04", 1); /* end of file for the terminal's reader */
			else
				proc_close_fd(p, &p->in_fd);
			ok(c);
			return;
		}
		spawn_worker(c, p->in_fd);
	} else if (!strcmp(op, "resize")) {
		if (!(p = need_proc(c)))
			return;
		struct winsize ws = {.ws_row = (unsigned short)field_num(&c->f, "rows", 24),
				     .ws_col = (unsigned short)field_num(&c->f, "cols", 80)};
		if (!p->pty || ioctl(p->out_fd, TIOCSWINSZ, &ws) < 0) {
			reply_error(c, p->pty ? errno : EINVAL, "resize needs a running process with a pty");
			return;
		}
		ok(c);
	} else if (!strcmp(op, "release")) {
		if (!(p = need_proc(c)))
			return;
		if (p->exited)
			proc_free(p);
		else
			p->release = 1;
		ok(c);
	} else if (!strcmp(op, "ps")) {
		op_list(c);
	} else if (!strcmp(op, "quiesce")) {
		op_quiesce(c);
	} else if (!strcmp(op, "ping")) {
		ob_fields_begin(&c->out, F_RESULT, &mark);
		ob_field(&c->out, "version", VERSION);
		ob_field(&c->out, "pid", "%d", getpid());
		ob_fields_end(&c->out, mark);
		finish(c);
	} else {
		spawn_worker(c, -1); /* files.c answers, or names the operation unknown */
	}
}

/* Read the request frame exactly (never past it: what follows belongs to a worker). */
static void conn_read(struct conn *c)
{
	for (;;) {
		char *dst = c->req ? c->req + c->got : c->head + c->got;
		size_t need = (c->req ? c->want : 4) - c->got;
		ssize_t n = recv(c->fd, dst, need, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			conn_close(c);
			return;
		}
		c->got += (size_t)n;
		if (!c->req && c->got == 4) {
			unsigned char *h = (unsigned char *)c->head;
			c->want = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | h[3];
			if (c->want < 2 || c->want > FRAME_MAX) {
				reply_error(c, EINVAL, "bad frame length");
				return;
			}
			c->req = malloc(c->want + 1);
			c->got = 0;
		} else if (c->req && c->got == c->want) {
			c->req[c->want] = 0; /* the fields end with a NUL; this one guards a missing one */
			if (c->req[0] != F_REQUEST) {
				reply_error(c, EINVAL, "expected a request frame");
				return;
			}
			c->f.buf = c->req + 1;
			c->f.len = c->want - 1;
			dispatch(c);
			return;
		}
	}
}

static void conn_event(struct conn *c, unsigned ev)
{
	if (c->state == C_WORKER) {
		if (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))
			kill(c->worker, SIGKILL); /* closed once reaped */
		return;
	}
	if (ev & EPOLLOUT) {
		if (conn_flush(c) && c->state == C_STREAM)
			pump(c);
		return;
	}
	if (c->state == C_REQ) {
		conn_read(c);
	} else if (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
		conn_close(c); /* a follower or waiter that left */
	} else {
		/* a client that sends after its request: drain and ignore */
		char sink[256];
		if (recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT) == 0)
			conn_close(c);
	}
}

static void housekeeping(void)
{
	long long now = now_ms();
	time_t wall = time(NULL);
	struct conn *cn;
	struct proc *pn;

	for (struct conn *c = conns; c; c = cn) {
		cn = c->next;
		if (c->state == C_STREAM && c->deadline && now >= c->deadline)
			reply_error(c, ETIMEDOUT, "the process is still running");
	}
	for (struct proc *p = procs; p; p = pn) {
		pn = p->next;
		if (p->exited && !followed(p->pid) && wall - p->exit_time > retain_s)
			proc_free(p);
	}
}

static int listen_on(const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	char dir[sizeof(a.sun_path)];
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

	if (strlen(path) >= sizeof(a.sun_path)) {
		fprintf(stderr, "k3sys-agent: socket path too long: %s\n", path);
		exit(2);
	}
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = 0;
		mkdir(dir, 0700);
	}
	strcpy(a.sun_path, path);
	unlink(path);
	mode_t old = umask(077); /* the socket: root's only */
	if (bind(s, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(s, 128) < 0) {
		fprintf(stderr, "k3sys-agent: cannot listen on %s: %s\n", path, strerror(errno));
		exit(2);
	}
	umask(old);
	return s;
}

int main(int argc, char **argv)
{
	const char *sock = "/.k3sys/agent.sock";
	struct watch lw = {K_LISTEN, NULL}, sw = {K_SIGNAL, NULL};

	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--socket"))
			sock = argv[i + 1];
		else if (!strcmp(argv[i], "--ring"))
			ring_default = (size_t)strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--retain"))
			retain_s = strtol(argv[i + 1], NULL, 10);
	}
	int ls = listen_on(sock);
	/* Orphans come to us even when we are not PID 1 (run by hand, in tests). */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	if (getpid() == 1) {
		/* runc hands PID 1 host-side stdio, which CRIU cannot dump; runc's caller waits for us to
		 * drop it (it reads the pipes to their end), so by the time create returns we are ready. */
		int nul = open("/dev/null", O_RDWR);
		dup2(nul, 0);
		dup2(nul, 1);
		dup2(nul, 2);
		if (nul > 2)
			close(nul);
	}
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&handled);
	sigaddset(&handled, SIGCHLD);
	sigaddset(&handled, SIGTERM);
	sigaddset(&handled, SIGINT);
	sigprocmask(SIG_BLOCK, &handled, NULL);
	int sfd = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
	ep = epoll_create1(EPOLL_CLOEXEC);
	watch_fd(ls, &lw, EPOLLIN, EPOLL_CTL_ADD);
	watch_fd(sfd, &sw, EPOLLIN, EPOLL_CTL_ADD);

	for (;;) {
		struct epoll_event evs[64];
		long long tmo = 1000;
		for (struct conn *c = conns; c; c = c->next)
			if (c->state == C_STREAM && c->deadline) {
				long long left = c->deadline - now_ms();
				tmo = left < tmo ? (left < 0 ? 0 : left) : tmo;
			}
		int n = epoll_wait(ep, evs, 64, (int)tmo);
		for (int i = 0; i < n; i++) {
			struct watch *w = evs[i].data.ptr;
			if (w->kind == K_LISTEN) {
				int fd;
				while ((fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
					struct conn *c = calloc(1, sizeof(*c));
					c->fd = fd;
					c->w = (struct watch){K_CONN, c};
					c->events = EPOLLIN | EPOLLRDHUP;
					c->next = conns;
					conns = c;
					watch_fd(fd, &c->w, c->events, EPOLL_CTL_ADD);
				}
			} else if (w->kind == K_SIGNAL) {
				struct signalfd_siginfo si;
				while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
					if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
						/* the container's stop: as PID 1 everything else in it; run by hand
						 * (tests), only what we started */
						if (getpid() == 1)
							kill(-1, SIGKILL);
						for (struct proc *p = procs; p; p = p->next)
							kill(-p->pid, SIGKILL);
						return 0;
					}
				}
				int status;
				pid_t pid;
				while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
					reaped(pid, status);
			} else if (w->kind == K_CONN) {
				/* a connection closed earlier in this batch is gone: check it is still listed */
				struct conn *c = conns;
				while (c && c != w->obj)
					c = c->next;
				if (c)
					conn_event(c, evs[i].events);
			} else {
				struct proc *p = w->obj, *q = procs;
				while (q && q != p)
					q = q->next;
				if (!q)
					continue;
				int *fd = w->kind == K_OUT ? &p->out_fd : &p->err_fd;
				if (*fd >= 0) {
					drain(p, fd, w->kind == K_OUT ? F_STDOUT : F_STDERR, 4 * CHUNK);
					pump_followers(p->pid);
				}
			}
		}
		housekeeping();
	}
}
