/*
 * User extended attributes (the user.* namespace only) of sandbox files, run by a file worker as
 * the requested user inside the sandbox (files.c). Requests carry them as `xattr.<hex name>=<hex
 * value>` fields (any byte but NUL in a name, any byte in a value); stat and list answer in the
 * same form. Bounded: XATTR_COUNT_MAX per request or entry, names up to XATTR_NAME_LEN_MAX bytes,
 * values up to XATTR_VALUE_LEN_MAX, and what one answer reports in all up to XATTR_ANSWER_MAX
 * bytes (the rest counted in `xattrs_dropped`): a sandbox's file cannot grow the host's memory.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>

#define XATTR_PREFIX "xattr."
#define USER_NS "user."

static char value_buf[XATTR_VALUE_LEN_MAX];
static char list_buf[65536]; /* XATTR_LIST_MAX: the kernel never lists more */
static char hex_buf[2 * XATTR_VALUE_LEN_MAX + 1];
static size_t answered; /* bytes of xattrs this worker's answer carries so far */

static int nibble(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* `n` lowercase hex digits of `s` into n/2 bytes of `out`; -1 if one is not a digit. */
static int unhex(const char *s, size_t n, char *out)
{
	for (size_t i = 0; i < n; i += 2) {
		int hi = nibble(s[i]), lo = nibble(s[i + 1]);
		if (hi < 0 || lo < 0)
			return -1;
		out[i / 2] = (char)(hi << 4 | lo);
	}
	return 0;
}

static const char *hex(const char *p, size_t n)
{
	static const char digits[] = "0123456789abcdef";
	for (size_t i = 0; i < n; i++) {
		hex_buf[2 * i] = digits[(unsigned char)p[i] >> 4];
		hex_buf[2 * i + 1] = digits[(unsigned char)p[i] & 15];
	}
	hex_buf[2 * n] = 0;
	return hex_buf;
}

/* The next `xattr.` field of `req` after `*at` (start with NULL): its name and value decoded
 * into `name` and `value_buf`; 1, 0 at the end, -1 (with `o` holding the error) if malformed. */
static int next_xattr(struct obuf *o, const struct fields *req, const char **at, char name[XATTR_NAME_LEN_MAX + 1],
		      size_t *vlen)
{
	const char *p = *at ? *at + strlen(*at) + 1 : req->buf;
	for (; p < req->buf + req->len; p += strlen(p) + 1) {
		if (strncmp(p, XATTR_PREFIX, strlen(XATTR_PREFIX)))
			continue;
		*at = p;
		const char *hn = p + strlen(XATTR_PREFIX), *eq = strchr(hn, '=');
		size_t nlen = eq ? (size_t)(eq - hn) : 0, hlen = eq ? strlen(eq + 1) : 0;
		if (!eq || nlen % 2 || hlen % 2) {
			ob_error(o, EINVAL, "xattr: a field that is not hex name=hex value: %.64s", p);
			return -1;
		}
		if (nlen / 2 > XATTR_NAME_LEN_MAX || hlen / 2 > XATTR_VALUE_LEN_MAX) {
			ob_error(o, E2BIG, "xattr: name over %d or value over %d bytes: %.64s", XATTR_NAME_LEN_MAX,
				 XATTR_VALUE_LEN_MAX, p);
			return -1;
		}
		if (unhex(hn, nlen, name) < 0 || unhex(eq + 1, hlen, value_buf) < 0) {
			ob_error(o, EINVAL, "xattr: not hex: %.64s", p);
			return -1;
		}
		name[nlen / 2] = 0;
		*vlen = hlen / 2;
		if (strlen(name) != nlen / 2 || strncmp(name, USER_NS, strlen(USER_NS)) || !name[strlen(USER_NS)]) {
			ob_error(o, EINVAL, "xattr: only user.<name> attributes may be set, got %.300s", name);
			return -1;
		}
		return 1;
	}
	return 0;
}

int xattrs_check(struct obuf *o, const struct fields *req, int *count)
{
	const char *at = NULL;
	char name[XATTR_NAME_LEN_MAX + 1];
	size_t vlen;
	int r;

	*count = 0;
	while ((r = next_xattr(o, req, &at, name, &vlen)) > 0)
		if (++*count > XATTR_COUNT_MAX) {
			ob_error(o, E2BIG, "xattr: more than %d attributes", XATTR_COUNT_MAX);
			return -1;
		}
	return r;
}

int xattrs_apply(struct obuf *o, int fd, const char *path, const struct fields *req)
{
	const char *at = NULL;
	char name[XATTR_NAME_LEN_MAX + 1];
	size_t vlen;
	int r;

	while ((r = next_xattr(o, req, &at, name, &vlen)) > 0)
		if ((fd >= 0 ? fsetxattr(fd, name, value_buf, vlen, 0) : setxattr(path, name, value_buf, vlen, 0)) < 0) {
			ob_error(o, errno, "setxattr %s %s: %s", path, name, strerror(errno));
			return -1;
		}
	return r;
}

void xattrs_fields(struct obuf *o, const char *path, int follow)
{
	ssize_t n = follow ? listxattr(path, list_buf, sizeof(list_buf)) : llistxattr(path, list_buf, sizeof(list_buf));
	int count = 0, dropped = 0;

	for (ssize_t i = 0; i < n; i += (ssize_t)strlen(list_buf + i) + 1) {
		const char *name = list_buf + i;
		if (strncmp(name, USER_NS, strlen(USER_NS)))
			continue; /* trusted.*, security.*: not the user's to see or set */
		size_t nlen = strlen(name);
		ssize_t v = nlen > XATTR_NAME_LEN_MAX || count >= XATTR_COUNT_MAX ? -1
			: follow ? getxattr(path, name, value_buf, sizeof(value_buf))
				 : lgetxattr(path, name, value_buf, sizeof(value_buf));
		if (v < 0 || answered + nlen + (size_t)v > XATTR_ANSWER_MAX) { /* ERANGE: over the cap */
			dropped++;
			continue;
		}
		char key[sizeof(XATTR_PREFIX) + 2 * XATTR_NAME_LEN_MAX];
		snprintf(key, sizeof(key), XATTR_PREFIX "%s", hex(name, nlen));
		ob_field(o, key, "%s", hex(value_buf, (size_t)v));
		answered += nlen + (size_t)v;
		count++;
	}
	if (dropped)
		ob_field(o, "xattrs_dropped", "%d", dropped);
}
