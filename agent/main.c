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
 * The processes it starts are in proc.c, the answers to requests in requests.c; the state they
 * share in loop.h.
 *
 * Usage: k3sys-agent [--socket PATH] [--ring BYTES] [--ring-total BYTES] [--retain SECONDS]
 */
#define _GNU_SOURCE
#include "loop.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
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

int ep;
struct proc *procs;
struct conn *conns;
size_t ring_default = 16u << 20;
size_t ring_total = 64u << 20;
long retain_s = 600;
char readbuf[CHUNK];
sigset_t handled;

long long now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

void watch_fd(int fd, struct watch *w, unsigned events, int op)
{
	struct epoll_event e = {.events = events, .data.ptr = w};
	epoll_ctl(ep, op, fd, &e);
}

struct proc *find_proc(pid_t pid)
{
	for (struct proc *p = procs; p; p = p->next)
		if (p->pid == pid)
			return p;
	return NULL;
}

/* --- connections -------------------------------------------------------------------------- */

/* Connections closed during the current batch of events, freed after it: a connection accepted
 * later in the batch must not get a closed one's address, or the closed one's pending events (its
 * client leaving: kill the worker) would be taken for the new one's. */
static struct conn *closed;

void conn_close(struct conn *c)
{
	for (struct conn **l = &conns; *l; l = &(*l)->next)
		if (*l == c) {
			*l = c->next;
			break;
		}
	/* Dropped from the epoll set by name: close alone would not while a worker forked just now
	 * still holds a copy of the socket, and its events would keep coming with `c`'s address. */
	epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
	close(c->fd);
	c->next = closed;
	closed = c;
}

static void free_closed(void)
{
	while (closed) {
		struct conn *c = closed;
		closed = c->next;
		free(c->req);
		free(c->out.buf);
		free(c);
	}
}

void conn_want(struct conn *c, unsigned events)
{
	if (events != c->events) {
		watch_fd(c->fd, &c->w, events, EPOLL_CTL_MOD);
		c->events = events;
	}
}

/* Send what is queued without blocking; a finished request closes once all of it is out. Returns
 * 0 when the connection is gone (closed here), 1 otherwise. */
int conn_flush(struct conn *c)
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

void finish(struct conn *c)
{
	c->state = C_CLOSING;
	conn_flush(c);
}

void reply_error(struct conn *c, int err, const char *msg)
{
	ob_error(&c->out, err, "%s", msg);
	finish(c);
}

void end_fields(struct obuf *o, struct proc *p)
{
	if (WIFSIGNALED(p->status))
		ob_field(o, "signal", "%d", WTERMSIG(p->status));
	ob_field(o, "exit", "%d", WIFEXITED(p->status) ? WEXITSTATUS(p->status) : 128 + WTERMSIG(p->status));
	ob_field(o, "dropped", "%llu", (unsigned long long)p->ring.dropped);
	ob_field(o, "end", "%llu", (unsigned long long)p->ring.end);
}

int followed(pid_t pid)
{
	for (struct conn *c = conns; c; c = c->next)
		if (c->state == C_STREAM && c->pid == pid)
			return 1;
	return 0;
}

/* Move a following connection on: output from its position (a gap where the ring dropped bytes is
 * announced with an I frame), then, once the process has ended and all is sent, the R frame. */
void pump(struct conn *c)
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

void pump_followers(pid_t pid)
{
	struct conn *next;
	for (struct conn *c = conns; c; c = next) {
		next = c->next;
		if (c->state == C_STREAM && c->pid == pid)
			pump(c);
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
		else if (!strcmp(argv[i], "--ring-total"))
			ring_total = (size_t)strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--retain"))
			retain_s = strtol(argv[i + 1], NULL, 10);
	}
	/* A full output chunk (CHUNK and its header) is a mapping of its own, unmapped when dropped: the
	 * agent's memory (and what a checkpoint dumps of it) follows what its rings hold now, not the
	 * most they ever held. */
	mallopt(M_MMAP_THRESHOLD, CHUNK);
	/* Not dumpable, before anything in the sandbox can run: ptrace, process_vm_writev and
	 * /proc/1/mem then need CAP_SYS_PTRACE over our mm's user namespace, which no process of the
	 * sandbox has. Without it root inside could PTRACE_ATTACH and leave PID 1 stopped (every call
	 * to the sandbox waits) or write into it. Workers forked for requests inherit it; commands get
	 * it back at their execve. CRIU saves and restores the flag (docs/sandbox-security.md). */
	prctl(PR_SET_DUMPABLE, 0);
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
					if (!c) { /* the client sees its connection closed; PID 1 goes on */
						close(fd);
						continue;
					}
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
					pid_t pid = p->pid; /* drain may end and free a released PTY process */
					drain(p, fd, w->kind == K_OUT ? F_STDOUT : F_STDERR, 4 * CHUNK, 1);
					pump_followers(pid);
				}
			}
		}
		free_closed();
		proc_free_gone();
		housekeeping();
		readers_resume(); /* followers moved on or left during the batch */
	}
}
