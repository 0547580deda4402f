/*
 * The CRIU that runc runs for a k3sys restore started ahead (drivers/gate.py).
 *
 * runc spends ~15 ms (its own start, reading and checking the bundle, a CRIU version check) before
 * it needs the sandbox's mounts and images. The driver starts it that early, with this program as
 * its CRIU, and lets each CRIU run through once the sandbox is ready: every run reads one byte from
 * the FIFO $K3SYS_CRIU_GATE, and 'g' execs $K3SYS_CRIU with the same arguments. End of file (the
 * driver gave up, or died) exits 1, so runc fails at its version check, before it has touched the
 * sandbox. Without $K3SYS_CRIU_GATE it execs CRIU at once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	const char *criu = getenv("K3SYS_CRIU"), *gate = getenv("K3SYS_CRIU_GATE");

	(void)argc;
	if (criu == NULL || *criu == '\0') {
		fputs("k3sys-criu-gate: K3SYS_CRIU (the CRIU binary) is not set\n", stderr);
		return 1;
	}
	if (gate != NULL && *gate != '\0') {
		/* Non-blocking open: with no writer left (the driver closed its end) it must not wait for
		 * one; the read then sees end of file. Blocking reads from here on. */
		int fd = open(gate, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
		char c = 0;
		ssize_t n;

		if (fd < 0 || fcntl(fd, F_SETFL, 0) < 0) {
			perror(gate);
			return 1;
		}
		do
			n = read(fd, &c, 1);
		while (n < 0 && errno == EINTR);
		close(fd);
		if (n != 1 || c != 'g') {
			fputs("k3sys-criu-gate: the restore was called off before CRIU ran\n", stderr);
			return 1;
		}
	}
	argv[0] = (char *)criu;
	execv(criu, argv);
	perror(criu);
	return 127;
}
