/* A PTY process's relay: the one process that holds its terminal's master.
 *
 * Why not the agent itself: CRIU (4.1, tty.c tty_verify_ctty) refuses to dump a session whose
 * controlling terminal is open as /dev/tty (every interactive shell opens it) unless the first PTY
 * end of that session it meets, in its depth-first walk of the process tree, belongs to the process
 * that opened /dev/tty. The agent is PID 1, met first: a master it held always came first ("ctty
 * inheritance detected"). The relay is forked after the session's leader, so the walk meets the
 * leader's terminal first, and the dump and restore go through. It copies the master's output to a
 * pipe the agent reads into the ring, and the agent's stdin pipe to the master; the agent opens the
 * slave (O_NOCTTY) only for a moment to resize. */
#define _GNU_SOURCE
#include "loop.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <unistd.h>

/* The relay's loop on fds 3 (the master), 4 (output, to the agent) and 5 (input, from the agent).
 * It ends only when the agent closes the input pipe (it reaped the session's leader), first handing
 * over what the terminal still holds. Never when every slave is closed (EIO on the master): closing
 * the master hangs the slave up, and the hang-up sends SIGHUP to the session's leader, which may
 * still be alive (coreutils' cat closes its stdin, stdout and stderr and only then exits: ended by
 * SIGHUP in that gap, it exited 129 after a ^D in 1 to 14 runs of 100). From then on nothing is
 * read from the master (it reports only POLLHUP) and input is thrown away (nobody reads it). */
static void relay(void)
{
	static char in[CHUNK];
	size_t len = 0, off = 0; /* input read from the agent, not yet taken by the terminal */
	int slaves = 1;		 /* 0 once every slave is closed: the terminal's output is over */
	ssize_t n;

	prctl(PR_SET_NAME, "k3sys-pty");
	fcntl(3, F_SETFL, O_NONBLOCK);
	for (;;) {
		/* Input is read only once the last of it is in the terminal: a shell that does not read
		 * its input blocks the agent's stdin writer, not this loop's output. */
		struct pollfd p[2] = {{slaves ? 3 : -1, POLLIN | (len ? POLLOUT : 0), 0}, {len ? -1 : 5, POLLIN, 0}};
		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			_exit(1);
		}
		if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
			n = read(3, readbuf, sizeof(readbuf));
			if (n > 0 && write_all(4, readbuf, (size_t)n) < 0)
				_exit(0); /* the agent closed its end: the process was released */
			if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
				slaves = 0; /* EIO: every slave is closed; the master stays until the end */
		}
		if (len && (p[0].revents & POLLOUT) && (n = write(3, in + off, len - off)) > 0) {
			off += (size_t)n;
			if (off == len)
				len = off = 0;
		}
		if (!slaves)
			len = off = 0;
		if (p[1].revents & (POLLIN | POLLHUP)) {
			n = read(5, in, sizeof(in));
			if (n > 0) {
				len = slaves ? (size_t)n : 0;
			} else if (n == 0) {
				/* A nonblocking read of a master flushes what the slave wrote first. */
				while ((n = read(3, readbuf, sizeof(readbuf))) > 0 && write_all(4, readbuf, (size_t)n) == 0)
					;
				_exit(0);
			}
		}
	}
}

pid_t pty_relay(int master, int *out_fd, int *in_fd)
{
	int out[2], in[2];

	if (pipe2(out, O_CLOEXEC) < 0)
		return -1;
	if (pipe2(in, O_CLOEXEC) < 0) {
		close(out[0]);
		close(out[1]);
		return -1;
	}
	pid_t pid = fork();
	if (pid == 0) {
		int keep[] = {master, out[1], in[0]};
		child_reset(keep, 3);
		relay();
	}
	close(out[1]);
	close(in[0]);
	if (pid < 0) {
		close(out[0]);
		close(in[1]);
		return -1;
	}
	*out_fd = out[0];
	*in_fd = in[1];
	return pid;
}
