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

static void watch_forget(struct watches *w, int wd)
{
	for (size_t i = 0; i < w->n; i++)
		if (w->wd[i] == wd) {
			free(w->path[i]);
			w->path[i] = NULL;
		}
}

/* Watch `path` and, with `recursive`, every directory below it (iteratively, links not followed).
 * Returns the errno of watching `path` itself (0: watched); subdirectories that cannot be watched
 * are skipped. */
static int watch_tree(int ino, struct watches *w, const char *path, int recursive)
{
	struct names queue = {0};
	int err = 0;

	names_push(&queue, path);
	for (size_t i = 0; i < queue.n; i++) {
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
		if (slot == w->n) {
			if (w->n == w->cap) {
				w->cap = w->cap ? w->cap * 2 : 64;
				w->wd = realloc(w->wd, w->cap * sizeof(*w->wd));
				w->path = realloc(w->path, w->cap * sizeof(*w->path));
				if (!w->wd || !w->path)
					abort();
			}
			w->wd[w->n++] = wd;
		} else
			free(w->path[slot]);
		w->path[slot] = strdup(dir);
		DIR *d = recursive ? opendir(dir) : NULL;
		struct dirent *e;
		while (d && (e = readdir(d))) {
			char child[PATH_MAX];
			if (e->d_type != DT_DIR || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
				continue;
			snprintf(child, sizeof(child), "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name);
			names_push(&queue, child);
		}
		if (d)
			closedir(d);
	}
	for (size_t i = 0; i < queue.n; i++)
		free(queue.v[i]);
	free(queue.v);
	return err;
}

/* Report why a watch could not start. The inotify limits that run out are the sandbox's own, per
 * user of its user namespace (EMFILE: instances, ENOSPC: watches; the host sets them, see
 * docs/sandbox-security.md): name the limit and its value, as /proc/sys/user has it. */
static void watch_failed(struct obuf *o, const char *path, int err)
{
	const char *limit = err == EMFILE ? "max_inotify_instances" : err == ENOSPC ? "max_inotify_watches" : NULL;
	char file[64], value[32] = "?";
	FILE *f;

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
	struct watches w = {0};
	size_t mark;
	int ino = inotify_init1(IN_CLOEXEC);
	int err = ino < 0 ? errno : watch_tree(ino, &w, path, recursive);

	if (err) {
		watch_failed(o, path, err);
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
			if (ev->len)
				snprintf(full, sizeof(full), "%s/%s", strcmp(dir, "/") ? dir : "", ev->name);
			else
				snprintf(full, sizeof(full), "%s", dir);
			ob_fields_begin(o, F_INFO, &mark);
			ob_field(o, "type", "%s", type);
			ob_field(o, "path", "%s", full);
			if (ev->mask & IN_ISDIR)
				ob_field(o, "dir", "1");
			ob_fields_end(o, mark);
			if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)))
				watch_tree(ino, &w, full, 1);
		}
	}
}
