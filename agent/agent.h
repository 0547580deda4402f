/* k3sys-agent: the sandbox's PID 1 (main.c, proc.c, requests.c; loop.h), its output rings (ring.c) and
 * file workers (files.c, watch.c). */
#ifndef K3SYS_AGENT_H
#define K3SYS_AGENT_H

#include "proto.h"

#include <sys/types.h>

/* One process's output: stdout and stderr records in write order, in chunks, bounded by `cap`
 * bytes of memory; the oldest chunks are dropped to make room (`dropped` counts their bytes), but
 * never one holding a byte at or past `keep` (what a follower has yet to send: the caller stops
 * reading the process instead, loop.h). Every ring's memory is counted in `rings_used`, which the
 * loop holds within the sandbox's total (main.c). Positions are byte offsets in the process's whole
 * output since its start. */
struct chunk {
	struct chunk *next;
	uint64_t pos; /* offset of data[0] */
	uint32_t len, cap;
	char stream; /* F_STDOUT or F_STDERR */
	char data[];
};

struct ring {
	struct chunk *head, *tail;
	struct chunk **tail_link; /* the pointer that points at tail */
	uint64_t start, end; /* offsets kept: [start, end) */
	uint64_t dropped;
	size_t used, cap; /* bytes of memory held by chunks, and the limit */
};

extern size_t rings_used; /* bytes of memory held by every ring's chunks */

/* Append `n` bytes of `stream`, then drop the oldest chunks before `keep` while over `cap`. */
void ring_append(struct ring *r, char stream, const char *p, size_t n, uint64_t keep);
/* Whether the oldest chunk may go: it is not the newest, and it ends at or before `keep`. */
int ring_droppable(const struct ring *r, uint64_t keep);
void ring_drop_oldest(struct ring *r);
/* The chunk holding offset `pos` (>= r->start, < r->end), or NULL. */
struct chunk *ring_find(struct ring *r, uint64_t pos);
void ring_free(struct ring *r);

/* A list of owned strings (paths), grown by names_push (files.c). */
struct names {
	char **v;
	size_t n, cap;
};
/* Append a copy of `name`: 0, or -1 with errno ENOMEM (the list is unchanged). */
int names_push(struct names *s, const char *name);
/* Free every name and the list. */
void names_free(struct names *s);
/* `dir`/`name` into `out` (PATH_MAX bytes): 0, or -1 with errno ENAMETOOLONG when it would not fit.
 * A path is refused, never cut: a cut one names another file. */
int path_join(char *out, const char *dir, const char *name);

/* Stream changes under directory `path` to the connection `fd` until the client leaves (watch.c). */
int op_watch(int fd, struct obuf *o, const char *path, int recursive);

/* User extended attributes (xattr.c): at most XATTR_COUNT_MAX per request or entry, names up to
 * XATTR_NAME_LEN_MAX bytes, values up to XATTR_VALUE_LEN_MAX, XATTR_ANSWER_MAX bytes in one answer. */
#define XATTR_COUNT_MAX 32
#define XATTR_NAME_LEN_MAX 255
#define XATTR_VALUE_LEN_MAX 4096
#define XATTR_ANSWER_MAX (1 << 20)
/* Check the request's xattr fields (`*count` of them): 0, or -1 with `o` holding the error. */
int xattrs_check(struct obuf *o, const struct fields *req, int *count);
/* Set them on `fd` (or on `path` when fd < 0): 0, or -1 with `o` holding the error. */
int xattrs_apply(struct obuf *o, int fd, const char *path, const struct fields *req);
/* Append the user.* xattrs of `path` (its target with `follow`) to the fields being written to `o`. */
void xattrs_fields(struct obuf *o, const char *path, int follow);

/* Run one file request (read, write, setxattr, stat, list, mkdir, move, remove) on the connection `fd`. */
int file_op(int fd, const char *op, const struct fields *req);
/* Before a worker becomes the requested user: make a write's (a mkdir's) missing directories as root
 * and give them to uid:gid, as E2B's envd does (files.c). */
void user_dirs(const char *op, const struct fields *req, uid_t uid, gid_t gid);

#endif
