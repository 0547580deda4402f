/*
 * The `watch` file request (files.c hands it here): inotify on a directory, optionally its whole
 * tree, streamed to the client as I frames until the client leaves. Runs in a file worker like
 * every file request, with no alarm (the client sends timeout=0).
 */
#define _GNU_SOURCE
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

/* The directories one `watch` watches: inotify watch descriptor -> the directory's path (NULL once
 * the kernel dropped the watch: the directory went). */
struct watches {
	int *wd;
	char **path;
	size_t n, cap;
};

#define WATCH_MASK (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_ONLYDIR)

static const char *watched(const struct watches *w, int wd)
{
	for (size_t i = 0; i < w->n; i++)
		if (w->wd[i] == wd)
			return w->path[i];
	return NULL;
}

/* Room for one more watch: 0, or -1 (no memory; `w` unchanged but perhaps with more room). */
static int watches_grow(struct watches *w)
{
	if (w->n < w->cap)
		return 0;
	size_t cap = w->cap ? w->cap * 2 : 64;
	int *wd = realloc(w->wd, cap * sizeof(*wd));
	if (!wd)
		return -1;
	w->wd = wd;
	char **path = realloc(w->path, cap * sizeof(*path));
	if (!path)
		return -1;
	w->path = path;
	w->cap = cap;
	return 0;
}

static void watch_forget(struct watches *w, int wd)
{
	for (size_t i = 0; i < w->n; i++)
		if (w->wd[i] == wd) {
			free(w->path[i]);
			w->path[i] = NULL;
		}
}

/* Watch `path` and, with `recursive`, every directory below it (iteratively, links not followed).
 * Returns the errno of watching `path` itself (0: watched), ENAMETOOLONG when a directory below has
 * a path over PATH_MAX (`*bad`: that path, cut for the message only; a cut path would watch another
 * directory), or ENOMEM; subdirectories that cannot be watched are skipped. */
static int watch_tree(int ino, struct watches *w, const char *path, int recursive, char *bad)
{
	struct names queue = {0};
	int err = names_push(&queue, path) < 0 ? ENOMEM : 0;

	for (size_t i = 0; !err && i < queue.n; i++) {
		const char *dir = queue.v[i];
		int wd = inotify_add_watch(ino, dir, WATCH_MASK | (i ? IN_DONT_FOLLOW : 0));
		if (wd < 0) {
			if (i == 0) {
				err = errno;
				break;
			}
			continue;
		}
		/* A directory watched already (moved within the tree) keeps its descriptor: rename it. */
		size_t slot = 0;
		while (slot < w->n && w->wd[slot] != wd)
			slot++;
		if (slot == w->n && watches_grow(w) < 0) {
			inotify_rm_watch(ino, wd);
			err = ENOMEM;
			break;
		}
		if (slot == w->n) {
			w->wd[w->n++] = wd;
			w->path[slot] = NULL;
		}
		size_t len = strlen(dir) + 1;
		char *copy = realloc(w->path[slot], len);
		if (!copy) {
			err = ENOMEM;
			break;
		}
		w->path[slot] = memcpy(copy, dir, len);
		DIR *d = recursive ? opendir(dir) : NULL;
		struct dirent *e;
		while (!err && d && (e = readdir(d))) {
			char child[PATH_MAX];
			if (e->d_type != DT_DIR || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
				continue;
			if (path_join(child, dir, e->d_name) < 0) {
				snprintf(bad, PATH_MAX, "%s/%s", dir, e->d_name);
				err = ENAMETOOLONG;
			} else if (names_push(&queue, child) < 0) {
				err = ENOMEM;
			}
		}
		if (d)
			closedir(d);
	}
	names_free(&queue);
	return err;
}

/* Report why a watch could not start. The inotify limits that run out are the sandbox's own, per
 * user of its user namespace (EMFILE: instances, ENOSPC: watches; the host sets them, see
 * docs/sandbox-security.md): name the limit and its value, as /proc/sys/user has it. */
static void watch_failed(struct obuf *o, const char *path, int err, const char *bad)
{
	const char *limit = err == EMFILE ? "max_inotify_instances" : err == ENOSPC ? "max_inotify_watches" : NULL;
	char file[64], value[32] = "?";
	FILE *f;

	if (err == ENAMETOOLONG && *bad) {
		ob_error(o, err, "watch %.200s...: the path of the directory %.200s... below is over PATH_MAX (%d bytes)",
			 path, bad, PATH_MAX);
		return;
	}
	if (!limit) {
		ob_error(o, err, "watch %s: %s", path, strerror(err));
		return;
	}
	snprintf(file, sizeof(file), "/proc/sys/user/%s", limit);
	if ((f = fopen(file, "re"))) {
		if (fgets(value, sizeof(value), f))
			value[strcspn(value, "\n")] = '\0';
		fclose(f);
	}
	ob_error(o, err, "watch %s: the inotify %s of uid %u in this sandbox ran out (%s: %s per user): %s", path,
		 err == EMFILE ? "instances" : "watches", (unsigned)geteuid(), limit, value, strerror(err));
}

static const char *event_type(uint32_t mask)
{
	if (mask & (IN_CREATE | IN_MOVED_TO))
		return "create";
	if (mask & IN_MODIFY)
		return "write";
	if (mask & IN_DELETE)
		return "remove";
	if (mask & IN_MOVED_FROM)
		return "rename";
	if (mask & IN_ATTRIB)
		return "chmod";
	return NULL;
}

/* Stream the changes under directory `path` as I frames (`type`, `path`, `dir=1` for a directory)
 * after one `I ready=1` (every watch is in place), until the client leaves (the agent then kills
 * this worker). A directory created or moved in later is watched too with `recursive` (what is
 * made inside it before its watch is in place is not reported). A kernel queue overflow is one
 * `I type=overflow`: events were lost. */
int op_watch(int fd, struct obuf *o, const char *path, int recursive)
{
	static char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
	static char bad[PATH_MAX];
	struct watches w = {0};
	size_t mark;
	int ino = inotify_init1(IN_CLOEXEC);
	int err = ino < 0 ? errno : watch_tree(ino, &w, path, recursive, bad);

	if (err) {
		watch_failed(o, path, err, bad);
		return -1;
	}
	ob_fields_begin(o, F_INFO, &mark);
	ob_field(o, "ready", "1");
	ob_fields_end(o, mark);
	for (;;) {
		if (flush_blocking(fd, o) < 0)
			return -1;
		ssize_t n = read(ino, buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			ob_error(o, errno, "watch %s: %s", path, strerror(errno));
			return -1;
		}
		for (char *p = buf; p < buf + n;) {
			const struct inotify_event *ev = (const struct inotify_event *)p;
			const char *dir = watched(&w, ev->wd), *type = event_type(ev->mask);
			char full[PATH_MAX];
			p += sizeof(*ev) + ev->len;
			if (ev->mask & IN_Q_OVERFLOW) {
				ob_fields_begin(o, F_INFO, &mark);
				ob_field(o, "type", "overflow");
				ob_fields_end(o, mark);
			}
			if (ev->mask & IN_IGNORED)
				watch_forget(&w, ev->wd);
			if (!dir || !type)
				continue;
			if (ev->len ? path_join(full, dir, ev->name) < 0 : snprintf(full, sizeof(full), "%s", dir) >= PATH_MAX) {
				/* the watch ends with an error rather than report a cut path (another file's) */
				ob_error(o, ENAMETOOLONG, "watch %.200s...: the path of a change in %.200s... is over PATH_MAX (%d bytes)",
					 path, dir, PATH_MAX);
				return -1;
			}
			ob_fields_begin(o, F_INFO, &mark);
			ob_field(o, "type", "%s", type);
			ob_field(o, "path", "%s", full);
			if (ev->mask & IN_ISDIR)
				ob_field(o, "dir", "1");
			ob_fields_end(o, mark);
			if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)) &&
			    ((err = watch_tree(ino, &w, full, 1, bad)) == ENAMETOOLONG || err == ENOMEM)) {
				/* (any other error: the new directory went already, its removal comes next) */
				watch_failed(o, full, err, bad);
				return -1;
			}
		}
	}
}
