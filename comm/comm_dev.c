/* comm_dev.c — device payloads between ranks (k3_comm_send_dev / k3_comm_recv_dev): a thin front
 * end over the transport's p2p_dev entry (comm_nccl.c); transports without one (mpi) report that
 * they have none, and the caller stages through host messages instead. */
#include "k3_comm.h"
#include "comm_internal.h"

bool k3_comm_device_payloads(const k3_comm *c) {
    return c && c->iface->p2p_dev != NULL;
}

static k3_status p2p(k3_comm *c, k3_backend *be, int peer, bool send, void *buf, int64_t n,
                     const char *what) {
    if (!k3_comm_device_payloads(c))
        return K3_ERR(K3_ERR_STATE, "%s: the %s transport has no device payloads", what,
                      c ? c->iface->name : "(none)");
    if (!be || n < 0 || (n > 0 && !buf) || peer < 0 || peer >= c->size || peer == c->rank)
        return K3_ERR(K3_ERR_ARG, "%s: bad device transfer (%lld floats, peer %d of %d)", what,
                      (long long)n, peer, c->size);
    if (n == 0) return K3_OK;
    return c->iface->p2p_dev(c, be, peer, send, buf, (size_t)n * sizeof(float), what);
}

k3_status k3_comm_send_dev(k3_comm *c, k3_backend *be, int peer, const float *x, int64_t n,
                           const char *what) {
    return p2p(c, be, peer, true, (void *)(uintptr_t)x, n, what);
}

k3_status k3_comm_recv_dev(k3_comm *c, k3_backend *be, int peer, float *x, int64_t n,
                           const char *what) {
    return p2p(c, be, peer, false, x, n, what);
}
