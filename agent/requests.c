/* Answering requests (loop.h): reading a request frame, dispatching it, the answers the loop gives
 * itself, and the forked workers for anything that may block (file operations, stdin). */
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

/* Longest `timeout=` a request may give (ms, about 34 years): deadlines computed from it cannot
 * overflow. */
#define TIMEOUT_MAX_MS (1LL << 40)

/* The request's `timeout=` (ms; `dflt` when absent or empty, 0 = none) into `*ms`: 0, or -1 with an
 * EINVAL answer when it is not a number in [0, TIMEOUT_MAX_MS] (a negative one would otherwise mean
 * no deadline at all: setitimer refuses it and the worker would run unbounded). */
static int request_timeout(struct conn *c, long long dflt, long long *ms)
{
	const char *v = field_get(&c->f, "timeout", NULL);
	char *end, msg[128];

	*ms = dflt;
	if (!v || !*v)
		return 0;
	errno = 0;
	*ms = strtoll(v, &end, 10);
	if (errno || *end || *ms < 0 || *ms > TIMEOUT_MAX_MS) {
		snprintf(msg, sizeof(msg), "timeout=%.32s: not a number of ms from 0 (none) to %lld", v, TIMEOUT_MAX_MS);
		reply_error(c, EINVAL, msg);
		return -1;
	}
	return 0;
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
	long long timeout;

	if (request_timeout(c, 30000, &timeout) < 0)
		return;
	pid_t pid = fork();
	if (pid == 0) {
		int keep[] = {c->fd, in_fd};
		child_reset(keep, in_fd >= 0 ? 2 : 1);
		int fd = 3;
		struct obuf o = {0};
		char home[PATH_MAX];
		const char *op = c->f.buf;
		const char *user = field_get(&c->f, "user", NULL);
		struct itimerval t = {.it_value = {timeout / 1000, (timeout % 1000) * 1000}};

		fcntl(fd, F_SETFL, 0); /* blocking */
		/* The alarm ends a request stuck on a FIFO or a slow device; the client sees the stream end
		 * without a result and reports a timeout. */
		signal(SIGALRM, worker_alarm);
		setitimer(ITIMER_REAL, &t, NULL);
		uid_t uid;
		gid_t gid;
		if (user && *user && user_ids(user, &uid, &gid) == 0)
			user_dirs(op, &c->f, uid, gid);
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
		long long timeout;
		if (request_timeout(c, 0, &timeout) < 0)
			return;
		c->state = C_STREAM;
		c->pid = p->pid;
		c->output = !strcmp(op, "connect");
		c->pos = !from || !strcmp(from, "start") ? 0 : !strcmp(from, "now") ? p->ring.end : strtoull(from, NULL, 10);
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
		/* The slave for a moment (the relay holds the master), never as the agent's terminal. */
		int tty = p->pty && !p->exited ? open(p->tty, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC) : -1;
		if (tty < 0 || ioctl(tty, TIOCSWINSZ, &ws) < 0) {
			int e = p->pty && !p->exited ? errno : EINVAL;
			if (tty >= 0)
				close(tty);
			reply_error(c, e, "resize needs a running process with a pty");
			return;
		}
		close(tty);
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
void conn_read(struct conn *c)
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
			if (!c->req) {
				reply_error(c, ENOMEM, "no memory for the request");
				return;
			}
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

void conn_event(struct conn *c, unsigned ev)
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

