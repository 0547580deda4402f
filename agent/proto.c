/* Frames and field lists: encoding for the agent's replies, decoding of requests. */
#define _GNU_SOURCE
#include "proto.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *field_get(const struct fields *f, const char *key, const char **from)
{
	size_t klen = strlen(key);
	const char *p = (from && *from) ? *from : f->buf;
	const char *end = f->buf + f->len;

	while (p < end) {
		size_t n = strnlen(p, (size_t)(end - p));
		const char *next = p + n + 1;
		if (n > klen && p[klen] == '=' && memcmp(p, key, klen) == 0) {
			if (from)
				*from = next;
			return p + klen + 1;
		}
		p = next;
	}
	return NULL;
}

long long field_num(const struct fields *f, const char *key, long long dflt)
{
	const char *v = field_get(f, key, NULL);
	char *end;
	long long x;

	if (!v || !*v)
		return dflt;
	errno = 0;
	x = strtoll(v, &end, 10);
	return (errno || *end) ? dflt : x;
}

static void ob_reserve(struct obuf *o, size_t n)
{
	if (o->len + n <= o->cap)
		return;
	if (o->off) { /* compact before growing */
		memmove(o->buf, o->buf + o->off, o->len - o->off);
		o->len -= o->off;
		o->off = 0;
		if (o->len + n <= o->cap)
			return;
	}
	size_t cap = o->cap ? o->cap : 4096;
	while (cap < o->len + n)
		cap *= 2;
	char *b = realloc(o->buf, cap);
	if (!b)
		abort(); /* PID 1 out of memory: the sandbox's memory cgroup decides, not us */
	o->buf = b;
	o->cap = cap;
}

static void put_len(char *p, uint32_t n)
{
	p[0] = (char)(n >> 24);
	p[1] = (char)(n >> 16);
	p[2] = (char)(n >> 8);
	p[3] = (char)n;
}

void ob_frame(struct obuf *o, char type, const void *data, size_t n)
{
	ob_reserve(o, n + 5);
	put_len(o->buf + o->len, (uint32_t)(n + 1));
	o->buf[o->len + 4] = type;
	if (n)
		memcpy(o->buf + o->len + 5, data, n);
	o->len += n + 5;
}

void ob_fields_begin(struct obuf *o, char type, size_t *mark)
{
	ob_reserve(o, 5);
	*mark = o->len;
	o->buf[o->len + 4] = type;
	o->len += 5;
}

void ob_field(struct obuf *o, const char *key, const char *fmt, ...)
{
	va_list ap;
	size_t klen = strlen(key);

	va_start(ap, fmt);
	int n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	ob_reserve(o, klen + (size_t)n + 2);
	memcpy(o->buf + o->len, key, klen);
	o->buf[o->len + klen] = '=';
	va_start(ap, fmt);
	vsnprintf(o->buf + o->len + klen + 1, (size_t)n + 1, fmt, ap);
	va_end(ap);
	o->len += klen + (size_t)n + 2; /* the value's NUL ends the field */
}

void ob_fields_end(struct obuf *o, size_t mark)
{
	put_len(o->buf + mark, (uint32_t)(o->len - mark - 4));
}

static const char *errno_name(int err)
{
	switch (err) {
	case ENOENT: return "ENOENT";
	case EEXIST: return "EEXIST";
	case ENOTDIR: return "ENOTDIR";
	case EISDIR: return "EISDIR";
	case EACCES: return "EACCES";
	case EPERM: return "EPERM";
	case ENAMETOOLONG: return "ENAMETOOLONG";
	case ELOOP: return "ELOOP";
	case ENOTEMPTY: return "ENOTEMPTY";
	case EXDEV: return "EXDEV";
	case ENOSPC: return "ENOSPC";
	case EMFILE: return "EMFILE";
	case EDQUOT: return "EDQUOT";
	case EROFS: return "EROFS";
	case ETIMEDOUT: return "ETIMEDOUT";
	case ESRCH: return "ESRCH";
	case EINVAL: return "EINVAL";
	case ENXIO: return "ENXIO";
	case EBUSY: return "EBUSY";
	case ENOEXEC: return "ENOEXEC";
	case E2BIG: return "E2BIG";
	case ENOMEM: return "ENOMEM";
	default: return "EIO";
	}
}

void ob_error(struct obuf *o, int err, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	size_t mark;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	ob_fields_begin(o, F_ERROR, &mark);
	ob_field(o, "code", "%s", errno_name(err));
	ob_field(o, "errno", "%d", err);
	ob_field(o, "msg", "%s", msg);
	ob_fields_end(o, mark);
}

int write_all(int fd, const void *p, size_t n)
{
	const char *c = p;

	while (n) {
		ssize_t w = write(fd, c, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

volatile sig_atomic_t frame_sending;

int flush_blocking(int fd, struct obuf *o)
{
	frame_sending = 1;
	int r = write_all(fd, o->buf + o->off, o->len - o->off);
	frame_sending = 0;
	o->len = o->off = 0;
	return r;
}

static int read_exact(int fd, char *p, size_t n)
{
	while (n) {
		ssize_t r = read(fd, p, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		p += r;
		n -= (size_t)r;
	}
	return 0;
}

int read_frame(int fd, char *buf, size_t *n)
{
	unsigned char h[4];

	if (read_exact(fd, (char *)h, 4) < 0)
		return -1;
	uint32_t len = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
	if (len < 1 || len > FRAME_MAX)
		return -1;
	if (read_exact(fd, buf, len) < 0)
		return -1;
	*n = len - 1;
	return (unsigned char)buf[0];
}
