/*
 * k3sys-agent wire format (docs/sandbox-agent.md has the whole protocol).
 *
 * A frame is a 4-byte big-endian length N, then N bytes: one type byte and N-1 bytes of payload.
 * Field lists (the payload of Q, I, R and X frames) are `key=value` strings each ended by a NUL;
 * the first field of a Q frame is the operation name alone.
 */
#ifndef K3SYS_AGENT_PROTO_H
#define K3SYS_AGENT_PROTO_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#define FRAME_MAX (1u << 20) /* largest frame payload + type byte */
#define CHUNK 65536          /* largest data frame the agent sends */

/* client -> agent */
#define F_REQUEST 'Q'
#define F_DATA 'D'
#define F_END 'Z'
/* agent -> client */
#define F_STDOUT 'O'
#define F_STDERR 'E'
#define F_INFO 'I'
#define F_RESULT 'R' /* final: success */
#define F_ERROR 'X'  /* final: failure (code=, errno=, msg=) */

struct fields {
	char *buf;    /* NUL-separated fields, owned */
	size_t len;
};

/* The value of the first field `key=...` in `f`, or NULL. `*from` (if given) resumes a search for
 * repeated keys: pass a pointer to NULL first. */
const char *field_get(const struct fields *f, const char *key, const char **from);
long long field_num(const struct fields *f, const char *key, long long dflt);

/* A growable output buffer of frames. */
struct obuf {
	char *buf;
	size_t len, off, cap;
};
void ob_frame(struct obuf *o, char type, const void *data, size_t n);
void ob_fields_begin(struct obuf *o, char type, size_t *mark);
void ob_field(struct obuf *o, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void ob_fields_end(struct obuf *o, size_t mark);
void ob_error(struct obuf *o, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Blocking helpers for the per-request workers; `frame_sending` is set while frames go out. */
extern volatile sig_atomic_t frame_sending;
int write_all(int fd, const void *p, size_t n);
int flush_blocking(int fd, struct obuf *o);
/* Read one frame; returns its type, -1 on EOF or error. `*data` points into `buf` (FRAME_MAX). */
int read_frame(int fd, char *buf, size_t *n);

#endif
