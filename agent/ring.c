/* Bounded output rings (agent.h). */
#include "agent.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK_MIN 4096

size_t rings_used;

void ring_drop_oldest(struct ring *r)
{
	struct chunk *c = r->head;

	r->head = c->next;
	if (r->tail_link == &c->next)
		r->tail_link = &r->head;
	if (!r->head)
		r->tail = NULL;
	r->start = r->head ? r->head->pos : r->end;
	r->dropped += c->len;
	r->used -= c->cap;
	rings_used -= c->cap;
	free(c);
}

int ring_droppable(const struct ring *r, uint64_t keep)
{
	return r->head && r->head != r->tail && r->head->pos + r->head->len <= keep;
}

void ring_append(struct ring *r, char stream, const char *p, size_t n, uint64_t keep)
{
	while (n) {
		struct chunk *t = r->tail;
		if (!t || t->stream != stream || t->len == t->cap) {
			/* Chunks grow with what arrives (a trickle of small writes does not pin 64 KiB each);
			 * a finished chunk is shrunk to its length so memory follows the bytes kept. */
			size_t cap = n < CHUNK_MIN ? CHUNK_MIN : (n > CHUNK ? CHUNK : n);
			if (t && t->len < t->cap) {
				struct chunk *s = realloc(t, sizeof(*t) + t->len);
				if (s) {
					r->used -= s->cap - s->len;
					rings_used -= s->cap - s->len;
					s->cap = s->len;
					*r->tail_link = s;
					r->tail = s;
				}
			}
			struct chunk *c = malloc(sizeof(*c) + cap);
			if (!c)
				abort();
			c->next = NULL;
			c->pos = r->end;
			c->len = 0;
			c->cap = (uint32_t)cap;
			c->stream = stream;
			r->tail_link = r->tail ? &r->tail->next : &r->head;
			*r->tail_link = c;
			r->tail = c;
			r->used += cap;
			rings_used += cap;
			t = c;
		}
		size_t k = t->cap - t->len < n ? t->cap - t->len : n;
		memcpy(t->data + t->len, p, k);
		t->len += (uint32_t)k;
		r->end += k;
		p += k;
		n -= k;
		while (r->used > r->cap && ring_droppable(r, keep))
			ring_drop_oldest(r);
	}
}

struct chunk *ring_find(struct ring *r, uint64_t pos)
{
	for (struct chunk *c = r->head; c; c = c->next)
		if (pos < c->pos + c->len)
			return pos >= c->pos ? c : NULL;
	return NULL;
}

void ring_free(struct ring *r)
{
	while (r->head)
		ring_drop_oldest(r);
}
