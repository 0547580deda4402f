/* The agent's loop state, shared by main.c (the loop, connections), proc.c (the processes it starts)
 * and requests.c (answering requests). One thread: nothing here is locked. */
#ifndef K3SYS_AGENT_LOOP_H
#define K3SYS_AGENT_LOOP_H

#include "agent.h"

#include <signal.h>
#include <sys/types.h>
#include <time.h>

#define VERSION "1"
#define OUT_HIGH (256u << 10) /* stop pumping output to a connection with this much unsent */
/* A followed process may always hold this much its follower has yet to send, whatever the other
 * rings hold: followers stalled elsewhere never stop it for good. */
#define RING_FLOOR (256u << 10)

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
	int out_fd, err_fd, in_fd; /* -1 when closed; with a PTY, pipes from and to its relay (pty.c) */
	int pty, reaped, exited, status, release; /* a PTY one has exited once reaped and its relay ended */
	int paused; /* its output pipes are not read (out of epoll): a follower has to catch up first */
	uint64_t max; /* output bytes past which its group is killed (0: no limit) */
	char tty[64]; /* a PTY's slave, opened briefly to resize it (op_start's slave_name: as long) */
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

extern int ep;
extern struct proc *procs;
extern struct conn *conns;
extern size_t ring_default, ring_total;
extern long retain_s;
extern char readbuf[CHUNK];
extern sigset_t handled;

/* main.c */
long long now_ms(void);
void watch_fd(int fd, struct watch *w, unsigned events, int op);
struct proc *find_proc(pid_t pid);
void conn_close(struct conn *c);
void conn_want(struct conn *c, unsigned events);
int conn_flush(struct conn *c);
void finish(struct conn *c);
void reply_error(struct conn *c, int err, const char *msg);
void end_fields(struct obuf *o, struct proc *p);
int followed(pid_t pid);
void pump(struct conn *c);
void pump_followers(pid_t pid);

/* proc.c */
void proc_close_fd(struct proc *p, int *fd);
void proc_free(struct proc *p); /* unlisted now, its memory released by proc_free_gone after the batch */
void proc_free_gone(void);
int drain(struct proc *p, int *fd, char stream, size_t budget, int hold);
void readers_resume(void);
int become(const char *user, char *home, size_t home_len);
int user_ids(const char *user, uid_t *uid, gid_t *gid);
void child_reset(const int *keep, int n);
void op_start(struct conn *c);
void reaped(pid_t pid, int status);

/* pty.c: fork the relay holding `master`; the agent's ends of its output and input pipes */
pid_t pty_relay(int master, int *out_fd, int *in_fd);

/* requests.c */
void conn_read(struct conn *c);
void conn_event(struct conn *c, unsigned ev);

#endif
