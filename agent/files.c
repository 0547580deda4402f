/*
 * File operations, each run by a worker process the agent forks for one request (agent.h): the
 * worker has already become the requested user and runs inside the sandbox's root, so a symlink,
 * device node or FIFO means what it means inside; a blocking open or read holds only this worker,
 * which an alarm (the request's timeout) ends.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char frame[FRAME_MAX];

static const char *type_name(mode_t m)
{
	switch (m & S_IFMT) {
	case S_IFREG: return "file";
	case S_IFDIR: return "dir";
	case S_IFLNK: return "symlink";
	case S_IFIFO: return "fifo";
	case S_IFSOCK: return "socket";
	case S_IFCHR: return "char";
	case S_IFBLK: return "block";
	default: return "unknown";
	}
}

/* The fields describing one entry (stat and list share them). */
static void entry_fields(struct obuf *o, int dirfd, const char *name, const char *path, const struct stat *st)
{
	ob_field(o, "path", "%s", path);
	ob_field(o, "type", "%s", type_name(st->st_mode));
	ob_field(o, "size", "%lld", (long long)st->st_size);
	ob_field(o, "mode", "%o", st->st_mode & 07777);
	ob_field(o, "uid", "%u", st->st_uid);
	ob_field(o, "gid", "%u", st->st_gid);
	ob_field(o, "mtime_ns", "%lld", (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec);
	if (S_ISLNK(st->st_mode)) {
		char target[PATH_MAX];
		ssize_t n = readlinkat(dirfd, name, target, sizeof(target) - 1);
		if (n >= 0) {
			target[n] = 0;
			ob_field(o, "target", "%s", target);
		}
	}
}

static int op_stat(struct obuf *o, const char *path, int follow, int xattrs)
{
	struct stat st;
	size_t mark;

	if ((follow ? stat(path, &st) : lstat(path, &st)) < 0) {
		ob_error(o, errno, "stat %s: %s", path, strerror(errno));
		return -1;
	}
	ob_fields_begin(o, F_RESULT, &mark);
	entry_fields(o, AT_FDCWD, path, path, &st);
	if (xattrs)
		xattrs_fields(o, path, follow);
	ob_fields_end(o, mark);
	return 0;
}

/* Stream a file's bytes: a regular file up to the size it had when opened, anything else (a FIFO,
 * /dev/zero) and a regular file of size 0 (procfs makes its files up as they are read) until end
 * of file or `max` bytes. A device node the sandbox may not use fails with the
 * EPERM the device cgroup gives. */
static int op_read(int fd, struct obuf *o, const char *path, long long offset, long long max)
{
	int f = open(path, O_RDONLY | O_NOCTTY | O_CLOEXEC);
	struct stat st;

	if (f < 0 || fstat(f, &st) < 0) {
		ob_error(o, errno, "open %s: %s", path, strerror(errno));
		return -1;
	}
	if (S_ISDIR(st.st_mode)) {
		ob_error(o, EISDIR, "%s is a directory", path);
		return -1;
	}
	long long left = S_ISREG(st.st_mode) && st.st_size > 0 ? st.st_size : max;
	if (offset > 0 && S_ISREG(st.st_mode)) { /* a reader resuming after a checkpoint cut it */
		if (lseek(f, offset, SEEK_SET) < 0) {
			ob_error(o, errno, "seek %s: %s", path, strerror(errno));
			return -1;
		}
		left = left > offset ? left - offset : 0;
	}
	if (max >= 0 && (left < 0 || left > max))
		left = max;
	long long total = 0;
	while (left != 0) {
		size_t want = CHUNK;
		if (left > 0 && (long long)want > left)
			want = (size_t)left;
		ssize_t n = read(f, frame, want);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			ob_error(o, errno, "read %s: %s", path, strerror(errno));
			return -1;
		}
		if (n == 0)
			break;
		ob_frame(o, F_DATA, frame, (size_t)n);
		if (flush_blocking(fd, o) < 0)
			return -1;
		total += n;
		if (left > 0)
			left -= n;
	}
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_field(o, "size", "%lld", total);
	ob_fields_end(o, mark);
	return 0;
}

/* Receive D frames until Z into `out`; -1 if the client went away or broke the protocol. */
static int receive_into(int fd, int out, struct obuf *o, const char *path, long long *total)
{
	size_t n;
	int t;

	*total = 0;
	while ((t = read_frame(fd, frame, &n)) == F_DATA) {
		if (write_all(out, frame + 1, n) < 0) {
			ob_error(o, errno, "write %s: %s", path, strerror(errno));
			return -1;
		}
		*total += (long long)n;
	}
	if (t != F_END) {
		ob_error(o, EINVAL, "write %s: the data ended without an end frame", path);
		return -1;
	}
	return 0;
}

/* mkdir -p: 0, or -1 with `o` holding the error. */
static int make_dirs(struct obuf *o, const char *path)
{
	char p[PATH_MAX];
	struct stat st;

	if (snprintf(p, sizeof(p), "%s", path) >= (int)sizeof(p)) {
		ob_error(o, ENAMETOOLONG, "mkdir %s: path too long", path);
		return -1;
	}
	for (char *s = p + 1;; s++) {
		if (*s == '/' || *s == 0) {
			char c = *s;
			*s = 0;
			if (mkdir(p, 0755) < 0 && !(errno == EEXIST && stat(p, &st) == 0 && S_ISDIR(st.st_mode))) {
				int err = errno == EEXIST ? ENOTDIR : errno;
				ob_error(o, err, "mkdir %s: %s", p, strerror(err));
				return -1;
			}
			*s = c;
			if (!c)
				break;
		}
	}
	return 0;
}

static int op_mkdir(struct obuf *o, const char *path)
{
	if (make_dirs(o, path) < 0)
		return -1;
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_fields_end(o, mark);
	return 0;
}

/* E2B's envd makes a write's missing parent directories (a mkdir's missing directories) as root and
 * gives them to the user, so the user can write /app/state.json on a fresh sandbox. Run by the worker
 * before it becomes the user; directories that exist are left as they are. Walked from / with
 * O_NOFOLLOW: at a symlink, or any error, it stops, and the user's own pass (file_op) goes on with
 * the user's rights and reports what it meets; a directory made here is chowned through its own fd. */
void user_dirs(const char *op, const struct fields *req, uid_t uid, gid_t gid)
{
	const char *path = field_get(req, "path", NULL);
	int write = !strcmp(op, "write") && field_num(req, "parents", 0) != 0;
	char p[PATH_MAX], *save = NULL;

	if ((!write && strcmp(op, "mkdir")) || !path || path[0] != '/' || strlen(path) >= sizeof(p))
		return;
	memcpy(p, path, strlen(path) + 1);
	if (write)
		*strrchr(p, '/') = 0;
	int dir = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	for (char *name = strtok_r(p, "/", &save); name && dir >= 0; name = strtok_r(NULL, "/", &save)) {
		int made = mkdirat(dir, name, 0755) == 0;
		int next = made || errno == EEXIST ? openat(dir, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
		close(dir);
		dir = next;
		if (dir >= 0 && made && fchownat(dir, "", uid, gid, AT_EMPTY_PATH) < 0) {
			close(dir);
			dir = -1;
		}
	}
	if (dir >= 0)
		close(dir);
}

/* `path` with symlinks in its last component followed (as open(O_CREAT) would), into `out`. */
static int follow_links(const char *path, char out[PATH_MAX])
{
	char target[PATH_MAX];
	struct stat st;

	snprintf(out, PATH_MAX, "%s", path);
	for (int hops = 0; hops < 40; hops++) {
		if (lstat(out, &st) < 0 || !S_ISLNK(st.st_mode))
			return 0;
		ssize_t n = readlink(out, target, sizeof(target) - 1);
		if (n < 0)
			return -1;
		target[n] = 0;
		if (target[0] == '/') {
			snprintf(out, PATH_MAX, "%s", target);
		} else {
			char *slash = strrchr(out, '/');
			size_t dir = slash ? (size_t)(slash - out) + 1 : 0;
			if (dir + (size_t)n >= PATH_MAX) {
				errno = ENAMETOOLONG;
				return -1;
			}
			memcpy(out + dir, target, (size_t)n + 1);
		}
	}
	errno = ELOOP;
	return -1;
}

/* Write: a regular or missing file is replaced atomically (a temporary file in the same directory,
 * then rename), keeping the old file's mode and owner; an existing FIFO or device is opened and
 * written as the sandbox would (a FIFO blocks this request until a reader comes or the timeout). A
 * symlink is followed inside the sandbox. */
static int op_write(int fd, struct obuf *o, const char *path, long long mode, int parents,
		    const struct fields *req, int xattrs)
{
	char real[PATH_MAX], tmp[PATH_MAX + 32];
	struct stat st;
	long long total;

	if (parents) {
		char dir[PATH_MAX];
		snprintf(dir, sizeof(dir), "%s", path);
		char *slash = strrchr(dir, '/');
		if (slash && slash != dir) {
			*slash = 0;
			if (make_dirs(o, dir) < 0)
				return -1;
		}
	}
	int have = stat(path, &st) == 0;

	if (have && S_ISDIR(st.st_mode)) {
		ob_error(o, EISDIR, "%s is a directory", path);
		return -1;
	}
	if (have && !S_ISREG(st.st_mode)) {
		if (xattrs) {
			ob_error(o, EINVAL, "write %s: xattrs are for regular files only", path);
			return -1;
		}
		int f = open(path, O_WRONLY | O_NOCTTY | O_CLOEXEC);
		if (f < 0) {
			ob_error(o, errno, "open %s: %s", path, strerror(errno));
			return -1;
		}
		if (receive_into(fd, f, o, path, &total) < 0)
			return -1;
		close(f);
	} else {
		/* A symlink is followed (inside the sandbox), even a dangling one, so the link stays a link
		 * and its target is written. */
		if (follow_links(path, real) < 0) {
			ob_error(o, errno, "write %s: %s", path, strerror(errno));
			return -1;
		}
		snprintf(tmp, sizeof(tmp), "%s.k3sys-%d", real, (int)getpid());
		mode_t m = have ? (st.st_mode & 07777) : (mode_t)(mode >= 0 ? mode : 0644);
		int f = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, m);
		if (f < 0) {
			ob_error(o, errno, "write %s: %s", path, strerror(errno));
			return -1;
		}
		/* The attributes go on before the rename: the new file appears with them, or not at all. */
		if (receive_into(fd, f, o, path, &total) < 0 || xattrs_apply(o, f, path, req) < 0) {
			unlink(tmp);
			return -1;
		}
		if (have && geteuid() == 0)
			(void)!fchown(f, st.st_uid, st.st_gid);
		(void)fchmod(f, m); /* the umask does not narrow a replaced file's mode */
		close(f);
		if (rename(tmp, real) < 0) {
			ob_error(o, errno, "write %s: %s", path, strerror(errno));
			unlink(tmp);
			return -1;
		}
	}
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_field(o, "size", "%lld", total);
	ob_fields_end(o, mark);
	return 0;
}

int names_push(struct names *s, const char *name)
{
	if (s->n == s->cap) {
		size_t cap = s->cap ? s->cap * 2 : 64;
		char **v = realloc(s->v, cap * sizeof(*v));
		if (!v)
			return -1;
		s->v = v;
		s->cap = cap;
	}
	char *copy = strdup(name);
	if (!copy)
		return -1;
	s->v[s->n++] = copy;
	return 0;
}

void names_free(struct names *s)
{
	for (size_t i = 0; i < s->n; i++)
		free(s->v[i]);
	free(s->v);
	*s = (struct names){0};
}

int path_join(char *out, const char *dir, const char *name)
{
	if (snprintf(out, PATH_MAX, "%s/%s", strcmp(dir, "/") ? dir : "", name) >= PATH_MAX) {
		errno = ENAMETOOLONG;
		return -1;
	}
	return 0;
}

/* Remove the tree under the directory `dirfd` (consumed), without recursion: descend into one
 * subdirectory at a time holding only the current directory open, climb back through "..", and
 * keep the names on a heap stack, so depth is bounded by memory, not the C stack or open files. */
static int remove_tree(int dirfd, const char *path, struct obuf *o)
{
	struct names stack = {0};
	int cur = dirfd, r = -1;

	for (;;) {
		DIR *d = fdopendir(dup(cur));
		struct dirent *e;
		char sub[NAME_MAX + 1] = "";
		if (!d) {
			ob_error(o, errno, "remove %s: %s", path, strerror(errno));
			goto out;
		}
		while ((e = readdir(d))) {
			if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
				continue;
			struct stat st;
			if (fstatat(cur, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
				if (!*sub)
					snprintf(sub, sizeof(sub), "%s", e->d_name);
			} else if (unlinkat(cur, e->d_name, 0) < 0 && errno != ENOENT) {
				ob_error(o, errno, "remove %s/.../%s: %s", path, e->d_name, strerror(errno));
				closedir(d);
				goto out;
			}
		}
		closedir(d);
		if (*sub) { /* down */
			int next = openat(cur, sub, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
			if (next < 0) {
				ob_error(o, errno, "remove %s: %s", path, strerror(errno));
				goto out;
			}
			if (names_push(&stack, sub) < 0) {
				ob_error(o, ENOMEM, "remove %s: no memory for its depth", path);
				close(next);
				goto out;
			}
			close(cur);
			cur = next;
			continue;
		}
		if (stack.n == 0) /* the top directory is empty */
			break;
		int up = openat(cur, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (up < 0) {
			ob_error(o, errno, "remove %s: %s", path, strerror(errno));
			goto out;
		}
		close(cur);
		cur = up;
		char *name = stack.v[--stack.n];
		int gone = unlinkat(cur, name, AT_REMOVEDIR) == 0 || errno == ENOENT;
		if (!gone)
			ob_error(o, errno, "remove %s/.../%s: %s", path, name, strerror(errno));
		free(name);
		if (!gone)
			goto out;
	}
	r = 0;
out:
	close(cur);
	names_free(&stack);
	return r;
}

static int op_remove(struct obuf *o, const char *path)
{
	struct stat st;

	if (lstat(path, &st) < 0) {
		ob_error(o, errno, "remove %s: %s", path, strerror(errno));
		return -1;
	}
	if (S_ISDIR(st.st_mode)) {
		int d = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (d < 0 || remove_tree(d, path, o) < 0) {
			if (d < 0)
				ob_error(o, errno, "remove %s: %s", path, strerror(errno));
			return -1;
		}
		if (rmdir(path) < 0) {
			ob_error(o, errno, "remove %s: %s", path, strerror(errno));
			return -1;
		}
	} else if (unlink(path) < 0) {
		ob_error(o, errno, "remove %s: %s", path, strerror(errno));
		return -1;
	}
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_fields_end(o, mark);
	return 0;
}

static int op_move(struct obuf *o, const char *from, const char *to)
{
	if (!to) {
		ob_error(o, EINVAL, "move: no destination (to=)");
		return -1;
	}
	if (rename(from, to) < 0) {
		ob_error(o, errno, "move %s to %s: %s", from, to, strerror(errno));
		return -1;
	}
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_fields_end(o, mark);
	return 0;
}

/* Set the request's user.* xattrs on `path` (a symlink followed, inside the sandbox). */
static int op_setxattr(struct obuf *o, const char *path, const struct fields *req)
{
	if (xattrs_apply(o, -1, path, req) < 0)
		return -1;
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_fields_end(o, mark);
	return 0;
}

/* List `path` breadth first down to `depth` levels (1 = its entries), one I frame per entry. Not
 * following symlinks; iterative (a queue of directory paths). */
static int op_list(int fd, struct obuf *o, const char *path, long long depth, int xattrs)
{
	struct names queue = {0};
	size_t head = 0, count = 0;
	struct stat st;

	int found = stat(path, &st) == 0;
	if (!found || !S_ISDIR(st.st_mode)) {
		int err = found ? ENOTDIR : errno;
		ob_error(o, err, "list %s: %s", path, strerror(err));
		return -1;
	}
	if (names_push(&queue, path) < 0)
		goto nomem;
	for (int level = 1; level <= depth && head < queue.n; level++) {
		size_t level_end = queue.n;
		for (; head < level_end; head++) {
			const char *dir = queue.v[head];
			int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
			DIR *d = dfd < 0 ? NULL : fdopendir(dfd);
			struct dirent *e;
			if (!d) {
				if (head == 0) {
					ob_error(o, errno, "list %s: %s", dir, strerror(errno));
					goto fail;
				}
				continue; /* an unreadable subdirectory is listed, not entered */
			}
			while ((e = readdir(d))) {
				char child[PATH_MAX];
				size_t mark;
				if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
					continue;
				if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
					continue;
				if (path_join(child, dir, e->d_name) < 0) {
					ob_error(o, ENAMETOOLONG, "list %.200s...: the path of its entry %.100s... is over PATH_MAX (%d bytes)",
						 path, e->d_name, PATH_MAX);
					closedir(d);
					goto fail;
				}
				ob_fields_begin(o, F_INFO, &mark);
				ob_field(o, "name", "%s", e->d_name);
				entry_fields(o, dirfd(d), e->d_name, child, &st);
				if (xattrs)
					xattrs_fields(o, child, 0);
				ob_fields_end(o, mark);
				count++;
				if ((S_ISDIR(st.st_mode) && level < depth && names_push(&queue, child) < 0) ||
				    (o->len > CHUNK && flush_blocking(fd, o) < 0)) {
					closedir(d);
					if (errno == ENOMEM)
						goto nomem;
					goto fail;
				}
			}
			closedir(d);
		}
	}
	names_free(&queue);
	size_t mark;
	ob_fields_begin(o, F_RESULT, &mark);
	ob_field(o, "count", "%zu", count);
	ob_fields_end(o, mark);
	return 0;
nomem:
	ob_error(o, ENOMEM, "list %s: no memory for its directories", path);
fail:
	names_free(&queue);
	return -1;
}

int file_op(int fd, const char *op, const struct fields *req)
{
	struct obuf o = {0};
	const char *path = field_get(req, "path", NULL);
	int r, xattrs = 0, want_xattrs = field_num(req, "xattrs", 0) != 0;

	const char *to = field_get(req, "to", NULL);

	if (!path || path[0] != '/') {
		ob_error(&o, EINVAL, "%s: path must be absolute, got %s", op, path ? path : "(none)");
		r = -1;
	} else if (strlen(path) >= PATH_MAX || (to && strlen(to) >= PATH_MAX)) {
		/* refused, never cut: every copy below assumes a path fits in PATH_MAX */
		ob_error(&o, ENAMETOOLONG, "%s: a path of %zu bytes is over PATH_MAX (%d bytes)", op,
			 strlen(path) >= PATH_MAX ? strlen(path) : strlen(to), PATH_MAX);
		r = -1;
	} else if (xattrs_check(&o, req, &xattrs) < 0) /* before a write takes any data */
		r = -1;
	else if (!strcmp(op, "read"))
		r = op_read(fd, &o, path, field_num(req, "offset", 0), field_num(req, "max", -1));
	else if (!strcmp(op, "write"))
		r = op_write(fd, &o, path, field_num(req, "mode", -1), field_num(req, "parents", 0) != 0, req, xattrs);
	else if (!strcmp(op, "setxattr"))
		r = op_setxattr(&o, path, req);
	else if (!strcmp(op, "stat"))
		r = op_stat(&o, path, field_num(req, "follow", 0) != 0, want_xattrs);
	else if (!strcmp(op, "list"))
		r = op_list(fd, &o, path, field_num(req, "depth", 1), want_xattrs);
	else if (!strcmp(op, "mkdir"))
		r = op_mkdir(&o, path);
	else if (!strcmp(op, "move"))
		r = op_move(&o, path, to);
	else if (!strcmp(op, "remove"))
		r = op_remove(&o, path);
	else if (!strcmp(op, "watch"))
		r = op_watch(fd, &o, path, field_num(req, "recursive", 0) != 0);
	else {
		ob_error(&o, EINVAL, "unknown operation %s", op);
		r = -1;
	}
	flush_blocking(fd, &o);
	return r;
}
