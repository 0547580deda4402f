/*
 * OCI prestart hook of k3sys sandboxes: set up the container's network namespace.
 *
 *   k3sys-net-up
 *       bring loopback up;
 *   k3sys-net-up FROM DEV ADDR/LEN GATEWAY SRC [-- CMD ARG...]
 *       also (network=True) move interface DEV from the network namespace mounted at FROM into the
 *       container's, give it ADDR/LEN and SRC/32, bring it up, route by default via GATEWAY from
 *       SRC, then run CMD inside the container's namespace (the driver's nftables rule).
 *
 * The container's network namespace is made by runc (or by CRIU, as empty, on a restore) inside
 * the sandbox's user namespace, so that CRIU can dump the sandbox; network setup is not saved in a
 * checkpoint, so this runs at every create and restore: runc runs prestart hooks during a restore
 * too, after the namespaces exist and before the processes (and their sockets) are restored. The
 * host end of the veth pair (docs/sandbox-network.md) is made beforehand, its other end waiting in
 * FROM. The container state JSON arrives on stdin; we need its "pid". One small static binary
 * speaking netlink instead of `sh` + `nsenter` + `ip`: process starts fewer on every restore.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

static int fail(const char *what)
{
	fprintf(stderr, "k3sys-net-up: %s: %s\n", what, strerror(errno));
	return 1;
}

static int up(const char *dev)
{
	struct ifreq ifr;
	memset(&ifr, 0, sizeof(ifr));
	strncpy(ifr.ifr_name, dev, sizeof(ifr.ifr_name) - 1);
	int sk = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (sk < 0 || ioctl(sk, SIOCGIFFLAGS, &ifr) < 0)
		return -1;
	ifr.ifr_flags |= IFF_UP;
	int r = ioctl(sk, SIOCSIFFLAGS, &ifr);
	close(sk);
	return r;
}

struct request {
	struct nlmsghdr h;
	union {
		struct ifinfomsg link;
		struct ifaddrmsg addr;
		struct rtmsg route;
	};
	char attrs[64];
};

static void attr(struct request *q, unsigned short type, const void *data, size_t len)
{
	struct rtattr *a = (struct rtattr *)((char *)q + NLMSG_ALIGN(q->h.nlmsg_len));
	a->rta_type = type;
	a->rta_len = RTA_LENGTH(len);
	memcpy(RTA_DATA(a), data, len);
	q->h.nlmsg_len = NLMSG_ALIGN(q->h.nlmsg_len) + RTA_ALIGN(a->rta_len);
}

/* Start request `q` of `type` with a body of `body` bytes (then `attr`, then `send_ack`). */
static void begin(struct request *q, unsigned short type, size_t body)
{
	static unsigned seq;
	q->h.nlmsg_len = NLMSG_LENGTH(body);
	q->h.nlmsg_type = type;
	q->h.nlmsg_flags |= NLM_F_REQUEST | NLM_F_ACK;
	q->h.nlmsg_seq = ++seq;
}

/* Send `q` on netlink socket `sk`; 0, or -1 with errno set from the kernel's answer. */
static int send_ack(int sk, struct request *q)
{
	char buf[4096];
	if (send(sk, q, q->h.nlmsg_len, 0) < 0)
		return -1;
	for (;;) {
		ssize_t n = recv(sk, buf, sizeof(buf), 0);
		if (n < 0)
			return -1;
		for (struct nlmsghdr *r = (struct nlmsghdr *)buf; NLMSG_OK(r, (size_t)n); r = NLMSG_NEXT(r, n)) {
			if (r->nlmsg_type == NLMSG_ERROR && r->nlmsg_seq == q->h.nlmsg_seq) {
				int err = ((struct nlmsgerr *)NLMSG_DATA(r))->error;
				errno = -err;
				return err ? -1 : 0;
			}
		}
	}
}

static int netlink(void)
{
	return socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
}

static int add_address(int sk, unsigned index, const char *cidr)
{
	char ip[INET_ADDRSTRLEN];
	const char *slash = strchr(cidr, '/');
	size_t len = slash ? (size_t)(slash - cidr) : strlen(cidr);
	struct in_addr a;
	if (len >= sizeof(ip))
		return errno = EINVAL, -1;
	memcpy(ip, cidr, len);
	ip[len] = '\0';
	if (inet_pton(AF_INET, ip, &a) != 1)
		return errno = EINVAL, -1;
	struct request q = {0};
	q.addr.ifa_family = AF_INET;
	q.addr.ifa_prefixlen = slash ? atoi(slash + 1) : 32;
	q.addr.ifa_index = index;
	q.h.nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
	begin(&q, RTM_NEWADDR, sizeof(q.addr));
	attr(&q, IFA_LOCAL, &a, sizeof(a));
	attr(&q, IFA_ADDRESS, &a, sizeof(a));
	return send_ack(sk, &q);
}

static int default_route(int sk, unsigned index, const char *gateway, const char *src)
{
	struct in_addr gw, from;
	if (inet_pton(AF_INET, gateway, &gw) != 1 || inet_pton(AF_INET, src, &from) != 1)
		return errno = EINVAL, -1;
	struct request q = {0};
	q.route.rtm_family = AF_INET;
	q.route.rtm_table = RT_TABLE_MAIN;
	q.route.rtm_protocol = RTPROT_BOOT;
	q.route.rtm_scope = RT_SCOPE_UNIVERSE;
	q.route.rtm_type = RTN_UNICAST;
	q.h.nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
	begin(&q, RTM_NEWROUTE, sizeof(q.route));
	attr(&q, RTA_GATEWAY, &gw, sizeof(gw));
	attr(&q, RTA_PREFSRC, &from, sizeof(from));
	attr(&q, RTA_OIF, &index, sizeof(index));
	return send_ack(sk, &q);
}

/* Move `dev` from the network namespace at `from` into `target` (a namespace descriptor), then,
 * inside `target`, address it and route through it. Leaves this process in `target`. */
static int wire(int target, const char *from, const char *dev, const char *cidr, const char *gateway,
		const char *src)
{
	int ns = open(from, O_RDONLY | O_CLOEXEC);
	if (ns < 0 || setns(ns, CLONE_NEWNET) < 0)
		return fail(from);
	int sk = netlink();
	unsigned index = if_nametoindex(dev);
	if (sk < 0 || !index)
		return fail(dev);
	struct request q = {0};
	q.link.ifi_family = AF_UNSPEC;
	q.link.ifi_index = (int)index;
	begin(&q, RTM_NEWLINK, sizeof(q.link));
	attr(&q, IFLA_NET_NS_FD, &target, sizeof(target));
	if (send_ack(sk, &q) < 0)
		return fail("moving the interface into the sandbox");
	close(sk);
	if (setns(target, CLONE_NEWNET) < 0)
		return fail("entering the network namespace");
	sk = netlink();
	index = if_nametoindex(dev);
	if (sk < 0 || !index)
		return fail(dev);
	if (add_address(sk, index, cidr) < 0 || add_address(sk, index, src) < 0)
		return fail("addressing the interface");
	if (up(dev) < 0)
		return fail("setting the interface up");
	if (default_route(sk, index, gateway, src) < 0)
		return fail("adding the default route");
	close(sk);
	return 0;
}

int main(int argc, char **argv)
{
	static char state[1 << 16];
	size_t n = 0;
	ssize_t r;

	if (argc != 1 && (argc < 6 || (argc > 6 && (strcmp(argv[6], "--") || argc == 7)))) {
		fprintf(stderr, "usage: k3sys-net-up [FROM DEV ADDR/LEN GATEWAY SRC [-- CMD ARG...]]\n");
		return 2;
	}
	while (n < sizeof(state) - 1 && (r = read(0, state + n, sizeof(state) - 1 - n)) > 0)
		n += (size_t)r;
	state[n] = '\0';

	const char *key = strstr(state, "\"pid\"");
	const char *colon = key ? strchr(key + 5, ':') : NULL;
	long pid = colon ? strtol(colon + 1, NULL, 10) : 0;
	if (pid <= 0) {
		fprintf(stderr, "k3sys-net-up: no \"pid\" in the container state on stdin\n");
		return 1;
	}

	char path[64];
	snprintf(path, sizeof(path), "/proc/%ld/ns/net", pid);
	int ns = open(path, O_RDONLY | O_CLOEXEC);
	if (ns < 0 || setns(ns, CLONE_NEWNET) < 0)
		return fail("entering the network namespace");
	if (up("lo") < 0)
		return fail("setting lo up");
	if (argc == 1)
		return 0;
	if (wire(ns, argv[1], argv[2], argv[3], argv[4], argv[5]))
		return 1;
	if (argc == 6)
		return 0;
	execv(argv[7], argv + 7); /* inside the sandbox's network namespace now */
	return fail(argv[7]);
}
