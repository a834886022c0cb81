/* kern_attn.h — part of kern_tmpl.h (included there, once per ISA unit): latent attention. */
